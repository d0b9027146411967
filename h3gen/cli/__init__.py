"""The `h3gen` command line. User errors print as one line and exit non-zero; no tracebacks.

One module per subcommand (`env`, `generate`, `serve`, `worker`, `plan`), each adding its parser and carrying it
out; `parser` builds the whole parser, `arguments` holds the flags they share, `checks` the argument checks made
before torch loads, `group` the start of `serve` and `worker` as a torchrun group, `progress` the progress bars.
Importing this package imports no torch: `h3gen --help` and refused arguments stay fast.
"""

import sys

from h3gen.cli.parser import build_parser
from h3gen.errors import CheckpointError, RequestError

__all__ = ["build_parser", "main"]


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` minus the given options and their values (both `--opt v` and `--opt=v`)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in options:
            skip = True
        elif not any(item.startswith(option + "=") for option in options):
            out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`); returns its exit code."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv_rest = _without(argv[1:], ("--model", "--seed"))  # for relaunching the same command under torchrun
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except (RequestError, CheckpointError) as error:
        print(f"h3gen: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("h3gen: interrupted", file=sys.stderr)
        return 130
