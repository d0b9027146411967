"""The `h3gen` argument parser: the top-level flags, and each subcommand's parser from its own module."""

import argparse

from h3gen.cli import env, generate, plan, serve, worker


def build_parser() -> argparse.ArgumentParser:
    """The parser of every `h3gen` command line; each subcommand sets `run`, the function that carries it out."""
    import h3gen

    parser = argparse.ArgumentParser(prog="h3gen", description="MiniMax-H3 video + audio generation.")
    parser.add_argument("--version", action="version", version=f"h3gen {h3gen.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    env.add_parser(commands)
    generate.add_parser(commands)
    serve.add_parser(commands)
    plan.add_parser(commands)
    worker.add_parser(commands)
    return parser
