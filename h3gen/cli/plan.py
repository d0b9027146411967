"""`h3gen plan`: a short idea made into an H3 prompt by a K3 planner, and the planner backends that `generate
--planner` and `serve --planner` use too."""

import argparse
import re
import sys

from h3gen.errors import RequestError


def add_parser(commands) -> None:
    """Adds `plan` and its flags to the subcommands."""
    plan = commands.add_parser(
        "plan",
        help="turn a short idea into an H3 prompt (picture, motion, camera, sound, "
        "music, dialogue) with a K3 planner; prints it",
    )
    plan.add_argument("prompt", help="the idea")
    plan.add_argument("--image", help="an image the video starts on (needs a planner that reads images)")
    plan.add_argument(
        "--model",
        default="tiny",
        help="K3 checkpoint folder, tiny (the random demo model, default), or an OpenAI-compatible base "
        "URL such as http://host:8000/v1",
    )
    plan.add_argument("--api-key", dest="api_key", help="key for a remote planner (or $H3GEN_PLANNER_API_KEY)")
    plan.add_argument("--max-tokens", dest="max_tokens", type=int, default=512, help="most tokens to write")
    plan.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    plan.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.6)")
    plan.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    plan.add_argument("--stream", action="store_true", help="print the text as it is written")
    plan.set_defaults(run=run_plan)


# What a terminal must not be sent: lone surrogates (undecodable bytes, which no UTF-8 encodes) and control characters
# (C0 but tab and newline, DEL, C1), so a model's text never moves the cursor or recolours the terminal.
_UNPRINTABLE = re.compile("[\ud800-\udfff\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` as valid UTF-8 text a terminal shows as it is: what cannot be encoded (lone surrogates, from undecodable
    bytes) and control characters become U+FFFD."""
    return _UNPRINTABLE.sub("\ufffd", text)


def planner_for(spec: str, device=None, api_key: str | None = None):
    """A planner backend for `--planner` / `plan --model`: "tiny", a K3 folder or an OpenAI-compatible base URL."""
    import os

    from h3gen.pipelines.k3.planner import make_planner

    if spec == "tiny":
        print(
            "h3gen: planning with the tiny demo K3 model: its weights are random, so the planned prompt is noise.",
            file=sys.stderr,
        )
    return make_planner(spec, device=device, api_key=api_key or os.environ.get("H3GEN_PLANNER_API_KEY"))


def run_plan(args: argparse.Namespace) -> int:
    """Carries out `h3gen plan`: the planned prompt on stdout, the timing on stderr."""
    from h3gen.pipelines.k3.planner import PlannerError

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RequestError("--device cuda was asked for but no CUDA device is available.", "device")
    if args.image is not None and not __import__("pathlib").Path(args.image).is_file():
        raise RequestError(f"--image {args.image} does not exist.", "image")
    planner = planner_for(args.model, args.device, args.api_key)
    show = (lambda text: print(printable(text), end="", flush=True)) if args.stream else None
    try:
        result = planner.plan(
            args.prompt,
            image=args.image,
            max_tokens=args.max_tokens,
            seed=args.seed,
            temperature=args.temperature,
            on_text=show,
        )
    except PlannerError as error:
        raise RequestError(str(error)) from None
    print() if args.stream else print(printable(result.planned))
    print(
        f"h3gen: planned by {result.backend} in {result.seconds:.1f} s"
        + (f", {result.tokens} tokens" if result.tokens is not None else ""),
        file=sys.stderr,
    )
    return 0
