"""The flag groups and flag types the subcommands share, and what parsed flags turn into. Nothing here imports torch:
`h3gen --help` and refused arguments stay fast."""

import argparse

from h3gen.options import (
    ATTENTION_BACKENDS,
    OFFLOAD_HELP,
    OFFLOAD_MODES,
    QUALITY_HELP,
    QUALITY_TIERS,
    QUANTIZATION_HELP,
    QUANTIZATIONS,
    RunOptions,
    describe,
)

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
REFERENCE_FLAGS = {"--ref-image": "image", "--ref-video": "video", "--ref-audio": "audio"}


class AppendReference(argparse.Action):
    """`--ref-image/--ref-video/--ref-audio PATH`, repeatable, into one list that keeps the command line's order."""

    def __call__(self, parser, namespace, value, option_string=None):
        references = list(getattr(namespace, self.dest) or [])
        references.append((REFERENCE_FLAGS[option_string], value, option_string))
        setattr(namespace, self.dest, references)


def references_of_args(args: argparse.Namespace) -> list | None:
    """The `--ref-image/--ref-video/--ref-audio` references in the command line's order, as the pipeline takes them
    (None when none is given)."""
    from h3gen.pipelines.h3 import AudioReference, ImageReference, VideoReference

    types = {"image": ImageReference, "video": VideoReference, "audio": AudioReference}
    return [types[kind](path, name=flag) for kind, path, flag in args.references] if args.references else None


def merge_lora_argument(parser) -> None:
    """`--merge-lora PATH` (repeatable): adapters merged into the model at load, `from_pretrained(loras=...)`."""
    parser.add_argument(
        "--merge-lora",
        dest="merge_loras",
        action="append",
        default=None,
        metavar="PATH",
        help="merge this adapter into the model when it loads (repeatable): a FastH3 adapter (fastvideo-lora-v2) "
        "makes the base model its 4-forward student; any other LoRA is merged at scale 1 and its few-step recipe "
        "applies to every request (default: none)",
    )


def lora_argument(text: str) -> tuple[str, float]:
    """`--lora PATH[:SCALE]` -> (path, scale); the scale defaults to 1.0."""
    path, _, scale = text.rpartition(":")
    if path:
        try:
            return path, float(scale)
        except ValueError:
            pass
    return text, 1.0


def sparsity_argument(text: str):
    """`--sparsity S`, `S1,S2,...` (one per forward) or `default` -> a float, a tuple of floats or "default" (the
    range is checked with the request)."""
    if text.strip() == "default":
        return "default"
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a number in [0, 1), comma-separated numbers (one per forward) or default, not {text!r}"
        ) from None
    return values[0] if len(values) == 1 else values


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless it has no value to show (None, a bare switch) or already says
    its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def run_option_arguments(parser: argparse.ArgumentParser, quality_help: str) -> None:
    """The `RunOptions` flags (`h3gen.options` holds their values and rules)."""
    parser.add_argument(
        "--quality", choices=QUALITY_TIERS, default="lossless", help=f"{describe(QUALITY_HELP)}; {quality_help}"
    )
    parser.add_argument("--offload", choices=OFFLOAD_MODES, default="none", help=describe(OFFLOAD_HELP))
    parser.add_argument(
        "--gpu-memory",
        dest="gpu_memory",
        default=None,
        help="GPU memory the transformer may use with --offload layerwise, e.g. 30GiB (needed there; default: unset)",
    )
    parser.add_argument("--prefetch", type=int, default=2, help="blocks copied ahead with --offload layerwise")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help=f"{describe(QUANTIZATION_HELP)} (default: the checkpoint's dtype)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        default=None,
        help="attention backend for the lossless and fast tiers instead of the tier's own choice "
        "(FP8 backends with --quality fast only; default: the tier's own)",
    )


def long_video_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of clips over 15 s (`pipelines/h3/continuation.py` holds their rules)."""
    from h3gen.pipelines.h3.continuation import (
        DEFAULT_MAX_SECONDS,
        DEFAULT_OVERLAP_FRAMES,
        DEFAULT_WINDOW_FRAMES,
        MAX_SECONDS_LIMIT,
    )

    parser.add_argument(
        "--max-seconds",
        dest="max_seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help=f"longest clip a request may ask for, 15 to {MAX_SECONDS_LIMIT:g} s (default {DEFAULT_MAX_SECONDS:g})",
    )
    parser.add_argument(
        "--window-frames",
        dest="window_frames",
        type=int,
        default=None,
        help=f"a clip over 15 s: frames per window, 17n+5 from 124 to 345 (default {DEFAULT_WINDOW_FRAMES})",
    )
    parser.add_argument(
        "--overlap-frames",
        dest="overlap_frames",
        type=int,
        default=None,
        help=f"a clip over 15 s: frames each window repeats of the previous one, 17n+5, shorter than "
        f"the window (default {DEFAULT_OVERLAP_FRAMES})",
    )


def run_options_of_args(args: argparse.Namespace, **keywords) -> RunOptions:
    """The validated `RunOptions` of the command line's flags."""
    return RunOptions(
        quality=args.quality,
        offload=args.offload,
        gpu_memory=args.gpu_memory,
        prefetch=args.prefetch,
        quantization=args.quantization,
        attention=args.attention,
        **keywords,
    )
