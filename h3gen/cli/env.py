"""`h3gen env`: versions, devices and codecs, one row each."""

import argparse


def add_parser(commands) -> None:
    """Adds `env` to the subcommands."""
    env = commands.add_parser("env", help="print versions, devices and codecs")
    env.set_defaults(run=run_env)


def run_env(args: argparse.Namespace) -> int:
    """Carries out `h3gen env`: one row per version, device or codec."""
    from h3gen.envreport import environment_report

    rows = environment_report()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0
