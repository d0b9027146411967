"""The `h3gen` command line. User errors print as one line and exit non-zero; no tracebacks."""

import argparse
import sys

from h3gen.errors import CheckpointError, RequestError


def _cmd_env(args: argparse.Namespace) -> int:
    from h3gen.envreport import environment_report

    rows = environment_report()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    import h3gen

    parser = argparse.ArgumentParser(prog="h3gen", description="MiniMax-H3 video + audio generation.")
    parser.add_argument("--version", action="version", version=f"h3gen {h3gen.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = commands.add_parser("env", help="print versions, devices and codecs")
    env.set_defaults(run=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
