"""`h3gen generate`: one MP4 with stereo audio from a prompt (and keyframes or references), in one process or
relaunched under torchrun for `--tp` / `--ulysses`. The arguments are checked before torch or any model loads."""

import argparse
import sys

from h3gen.cli.arguments import (
    DTYPES,
    AppendReference,
    long_video_arguments,
    lora_argument,
    merge_lora_argument,
    references_of_args,
    run_option_arguments,
    sparsity_argument,
)
from h3gen.cli.checks import check_generate_arguments, step_cache_of_args
from h3gen.cli.plan import planner_for
from h3gen.cli.progress import progress_bar, quiet_libraries, window_bar, with_previews
from h3gen.errors import RequestError
from h3gen.options import uses_step_cache
from h3gen.pipelines.h3 import CACHE_HELP


def add_parser(commands) -> None:
    """Adds `generate` and its flags to the subcommands."""
    gen = commands.add_parser(
        "generate", help="generate an MP4 with stereo audio from a prompt (and keyframes or references)"
    )
    gen.add_argument("prompt", help="what to generate, used verbatim")
    gen.add_argument("--model", help="local MiniMax-H3 checkpoint folder (default: the tiny random demo model)")
    gen.add_argument("--image", help="keyframe the video starts on (fl2va)")
    gen.add_argument("--last-image", dest="last_image", help="keyframe the video ends on (fl2va)")
    for flag, what in (
        ("--ref-image", "an image (subject, style, scene; up to 9)"),
        ("--ref-video", "a video (motion, camera; its soundtrack too; up to 3)"),
        ("--ref-audio", "an audio clip (voice, music; up to 3, not alone)"),
    ):
        gen.add_argument(
            flag,
            dest="references",
            action=AppendReference,
            metavar="PATH",
            help=f"ref2va reference: {what}; repeatable, references keep the command line's order",
        )
    gen.add_argument("--aspect", default=None, help="W:H from 1:4 to 4:1 (default 16:9, or the keyframe's)")
    gen.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="length, 5 to --max-seconds (default 5; ref2va: the length of the first reference with "
        "sound); over 15 s the clip is made in overlapping windows",
    )
    long_video_arguments(gen)
    gen.add_argument(
        "--prompt-per-window",
        dest="prompts",
        action="append",
        metavar="PROMPT",
        help="a clip over 15 s: the prompt of the next window (repeat once per window, or give one "
        "for all, or a JSON list); default: the prompt for every window",
    )
    gen.add_argument(
        "--steps",
        type=int,
        default=None,
        help="sigma grid points as diffusers counts them (num_inference_steps), 2 to 1000: N points run "
        "N - 1 transformer forwards (default 50, or the recipe's of a few-step LoRA)",
    )
    gen.add_argument(
        "--forwards",
        type=int,
        default=None,
        help="transformer forwards (SGLang's and vLLM-Omni's step count), 1 to 999, instead of --steps",
    )
    gen.add_argument(
        "--video-shift",
        dest="video_shift",
        type=float,
        default=None,
        help="video schedule shift (default: the model's, 12, or the recipe's)",
    )
    gen.add_argument(
        "--audio-shift",
        dest="audio_shift",
        type=float,
        default=None,
        help="audio schedule shift (default: the model's, 3, or the recipe's)",
    )
    gen.add_argument(
        "--sparsity",
        type=sparsity_argument,
        default=None,
        metavar="S|S1,S2,...|default",
        help="sparse attention (VSA-H3): the fraction of video tiles each video query tile drops, in [0, 1): one "
        "value, one per forward (comma-separated), or default (0.75 after the first fifth of the forwards ran dense); "
        "text, condition and audio rows stay dense (default: dense, or a FastH3 VSA student's 0.9)",
    )
    gen.add_argument(
        "--dense-forwards",
        dest="dense_forwards",
        type=int,
        default=None,
        help="with --sparsity: how many of the first forwards run dense attention",
    )
    gen.add_argument(
        "--lora",
        action="append",
        type=lora_argument,
        metavar="PATH[:SCALE]",
        help="apply a LoRA adapter (.safetensors, any MiniMax-H3 format) at SCALE (default 1.0); "
        "repeatable, adapters stack. A few-step adapter (LightX2V Turbo, FlashGen) brings its "
        "recipe: its forwards and shifts, unless --steps / --forwards say otherwise (refused)",
    )
    merge_lora_argument(gen)
    gen.add_argument("--seed", type=int, default=None, help="noise seed (default: random, printed at the end)")
    gen.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    gen.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    gen.add_argument("--audio-rate", dest="audio_rate", type=int, default=32000, help="AAC rate, 32000 or 48000")
    run_option_arguments(gen, "default lossless")
    for name, kind in (("threshold", float), ("warmup", int), ("max_consecutive", int)):
        gen.add_argument(
            f"--cache-{name.replace('_', '-')}",
            dest=f"cache_{name}",
            type=kind,
            default=None,
            help=f"with --quality high or fast+high: {CACHE_HELP[name]}",
        )
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (processes started with torchrun)")
    gen.add_argument("--ulysses", type=int, default=1, help="Ulysses sequence-parallel degree")
    gen.add_argument(
        "--planner",
        default=None,
        metavar="SPEC",
        help="first rewrite the prompt with a K3 planner: tiny (random demo), a K3 checkpoint folder, or "
        "an OpenAI-compatible base URL (key in $H3GEN_PLANNER_API_KEY)",
    )
    gen.add_argument(
        "--preview",
        metavar="FILE",
        default=None,
        help="while denoising, write a JPEG of the clip as it will come out to FILE, replaced as new ones come "
        "(about every tenth of the forwards and at least every 30 s, or --preview-every)",
    )
    gen.add_argument(
        "--preview-every",
        dest="preview_every",
        type=int,
        default=None,
        metavar="N",
        help="with --preview: a preview every N forwards (1 to 999)",
    )
    gen.add_argument("--out", required=True, help="output .mp4 path")
    gen.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Carries out `h3gen generate`: checks, then the model; rank 0 writes `--out`. Returns the exit code."""
    options = check_generate_arguments(args)
    import torch

    quiet_libraries()

    from h3gen.media import MediaError
    from h3gen.pipelines.h3 import (
        GenerationRequest,
        H3Checkpoint,
        check_max_seconds,
        load_time_contract,
        prepare_request,
        read_transformer_config,
        with_prompt,
    )

    if args.model is None:
        from h3gen.pipelines.h3.tiny_checkpoint import tiny_checkpoint

        print(
            "h3gen: no --model given: using the built-in tiny demo model. Its weights are random, so the picture "
            "and sound are noise.",
            file=sys.stderr,
        )
        args.model = str(tiny_checkpoint())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device cuda was asked for but no CUDA device is available.", "device")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    references = references_of_args(args)
    workflow = options.workflow
    cache = step_cache_of_args(args, options.quality)

    # Check the request against the checkpoint before loading any weights (or starting any process); its media are
    # decoded here, once.
    checkpoint = H3Checkpoint.open(args.model)
    checkpoint.require(workflow)
    config = read_transformer_config(checkpoint)
    max_seconds = check_max_seconds(args.max_seconds)
    loras, recipes = _loras(args, config.attention_head_dim)
    student, merged_recipes = load_time_contract(checkpoint, args.merge_loras, config.attention_head_dim)
    request = GenerationRequest(
        args.prompt,
        image=args.image,
        last_image=args.last_image,
        references=references,
        aspect_ratio=args.aspect,
        seconds=args.seconds,
        num_inference_steps=args.steps,
        forwards=args.forwards,
        video_shift=args.video_shift,
        audio_shift=args.audio_shift,
        seed=args.seed,
        cache=cache,
        loras=loras or None,
        prompts=_prompts(args),
        window_frames=args.window_frames,
        overlap_frames=args.overlap_frames,
        audio_sample_rate=args.audio_rate,
        sparsity=args.sparsity,
        dense_forwards=args.dense_forwards,
        preview_every=args.preview_every,
    )
    prepared = prepare_request(
        checkpoint, config, request, max_seconds=max_seconds, recipes=merged_recipes + recipes, student=student
    )
    if args.planner:
        if args.tp * args.ulysses > 1:
            raise RequestError(
                "--planner does not run under --tp / --ulysses yet; plan first with `h3gen plan` and "
                "pass its output as the prompt.",
                "planner",
            )
        from h3gen.pipelines.k3.planner import PlannerError

        planner = planner_for(args.planner, device)
        try:
            planned = planner.plan(
                args.prompt, image=args.image if planner.accepts_images else None, seed=prepared.seed
            ).planned
        except PlannerError as error:
            raise RequestError(str(error)) from None
        del planner  # its memory goes back before the video model loads
        prepared = with_prompt(prepared, planned)
        print(f"h3gen: planned prompt: {planned}", file=sys.stderr)
    parallel, rank = None, 0
    if args.tp * args.ulysses > 1:
        from h3gen.parallel.launch import launched_by_torchrun, relaunch_with_torchrun, start_rank
        from h3gen.parallel.state import check_degrees

        if not launched_by_torchrun():
            check_degrees(config.num_attention_heads, args.tp, args.ulysses)
            return relaunch_with_torchrun(
                args.tp * args.ulysses,
                ["generate", *args.argv_rest, "--model", args.model, "--seed", str(prepared.seed)],
            )
        parallel, device = start_rank(args.tp, args.ulysses, config.num_attention_heads, device)
        rank = torch.distributed.get_rank()

    from h3gen.pipelines.h3.pipeline import H3Pipeline

    if rank == 0:
        print(f"h3gen: loading {args.model} on {device} ({dtype_name})", file=sys.stderr)
    pipe = H3Pipeline.from_pretrained(
        args.model,
        device=device,
        torch_dtype=getattr(torch, DTYPES[dtype_name]),
        parallel=parallel,
        options=options,
        loras=args.merge_loras,
    )
    pipe.max_seconds = max_seconds
    if rank != 0:  # every rank runs the same steps; rank 0 decodes, reports and writes the file
        pipe.run(prepared, decode=False)
        return 0
    if prepared.continuation is not None:
        return _generate_long(pipe, args, prepared, options.quality)
    bar, callback = progress_bar(
        {
            "encode_text": 1,
            "encode_conditions": len(prepared.keyframes) + len(prepared.references),
            "denoise": prepared.sampling.forwards,
            "decode_video": 1,
            "decode_audio": 1,
            "write_mp4": 1,
        }
    )
    if args.preview:
        callback = with_previews(callback, args.preview)
    try:
        output = pipe.run(prepared, callback=callback, output_path=args.out)
    except torch.cuda.OutOfMemoryError:
        raise RequestError("the GPU ran out of memory: try fewer seconds, a smaller canvas or --dtype bf16.") from None
    except MediaError as error:
        raise RequestError(str(error)) from None
    finally:
        bar.close()
    print(summary_line(args.out, output, options.quality), file=sys.stderr)
    return 0


def summary_line(out, output, tier: str) -> str:
    """The last line of `generate`: the file and what it holds, the seed, the forwards (a long clip: all windows'),
    sigma points and shifts, the recipe, the adapters with their scales, the cached forwards, the previews."""
    info, sampling = output.media, output.sampling
    windows = f" in {output.windows} windows" if output.windows > 1 else ""
    forwards = output.num_forwards or sampling["forwards"]
    points = f"{sampling['num_inference_steps']} sigma points"
    if output.windows > 1:
        points = f"{sampling['forwards']} per window, {points} each"
    recipe = f", recipe {sampling['recipe']}" if sampling.get("recipe") else ""
    loras = ", ".join(f"{name} x{scale:g}" for name, scale in output.loras)
    plural = "s" if output.previews != 1 else ""
    previews = f", {output.previews} preview{plural} ({output.preview_seconds:.2f} s)" if output.previews else ""
    recipe += sparse_summary(sampling.get("sparsity"))
    return (
        f"h3gen: wrote {out}: {info.num_frames} frames {info.width}x{info.height} at {info.fps:g} fps{windows}, "
        f"stereo AAC {info.sample_rate} Hz, {info.video_seconds:.2f} s, seed {output.seed}; "
        f"{forwards} transformer forwards ({points}), shifts {sampling['video_shift']:g}/{sampling['audio_shift']:g}"
        f"{recipe}{', LoRA ' + loras if loras else ''}{_cached_summary(output, tier)}{previews}"
    )


def _prompts(args: argparse.Namespace) -> list[str] | None:
    """`--prompt-per-window`, repeated, or once as a JSON list."""
    import json

    given = args.prompts
    if given and len(given) == 1 and given[0].lstrip().startswith("["):
        try:
            given = json.loads(given[0])
        except ValueError:
            raise RequestError(
                "--prompt-per-window must be a prompt (repeat the flag) or a JSON list of prompts.", "prompts"
            ) from None
    return given


def _loras(args: argparse.Namespace, head_dim: int) -> tuple[list, list]:
    """The `--lora` adapters as `loras=` takes them, and the few-step recipes they bring (read from their headers,
    before any weights load)."""
    from pathlib import Path

    from h3gen.pipelines.h3 import read_lora, recipe_for

    loras, recipes = [], []
    for path, scale in args.lora or []:
        lora = read_lora(path, head_dim=head_dim)
        recipe = recipe_for(Path(path).name, lora.metadata)
        recipes += [recipe] if recipe else []
        loras.append((path, scale))
    return loras, recipes


def sparse_summary(sparsity: list[float] | None) -> str:
    """ ", sparse attention 0.9 on 4 of 4 forwards" for a request's per-forward sparsity; "" when dense."""
    sparse = [value for value in sparsity or () if value > 0]
    if not sparse:
        return ""
    values = "/".join(f"{value:g}" for value in dict.fromkeys(sparse))
    return f", sparse attention {values} on {len(sparse)} of {len(sparsity)} forwards"


def _cached_summary(output, tier: str) -> str:
    """What the final line says of the step cache: the forwards it skipped (quality high / fast+high)."""
    if not uses_step_cache(tier):
        return ""
    steps = ",".join(str(step) for step in output.cached_steps) or "none"
    return f", {len(output.cached_steps)} of {output.num_forwards} forwards cached (steps {steps})"


def _generate_long(pipe, args: argparse.Namespace, prepared, tier: str) -> int:
    """Rank 0 of a clip over 15 s (`prepared`, an `H3Request`): made window by window and streamed into `--out`."""
    import torch

    from h3gen.media import MediaError

    windows = prepared.continuation.num_windows
    bar, callback = window_bar(windows, prepared.sampling.forwards)
    if args.preview:
        callback = with_previews(callback, args.preview)
    try:
        output = pipe.run(prepared, callback=callback, output_path=args.out)
    except torch.cuda.OutOfMemoryError:
        raise RequestError(
            "the GPU ran out of memory: try a smaller canvas, a shorter window or --dtype bf16."
        ) from None
    except MediaError as error:
        raise RequestError(str(error)) from None
    finally:
        bar.close()
    print(summary_line(args.out, output, tier), file=sys.stderr)
    return 0
