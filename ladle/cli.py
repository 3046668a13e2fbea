"""`ladle` command line: each subcommand lives with the package it drives.

Subcommand modules are imported only when chosen, so `ladle --help` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Each module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "serve": ("ladle.server.cli", "serve a model over the OpenAI API"),
    "bench": ("ladle.bench.cli", "load-test any OpenAI-compatible server"),
    "calibrate": ("ladle.calibrate.cli", "fit a calibration of decision probabilities on labelled data"),
    "heads": ("ladle.heads.cli", "fit a learned decision head on the model's hidden states"),
    "router": ("ladle.router.cli", "route requests over several OpenAI-compatible workers, cache-aware"),
    "chat": ("ladle.chat", "chat in the terminal with a model in this process or at an OpenAI-compatible URL"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="ladle", description="ladle: a self-hosted LLM serving engine")
    parser.add_argument("--version", action="version", version=f"ladle {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)
        parser.print_help()
        return 0 if args.command is None else 2
    args = subcommand_parser(argv[0]).parse_args(argv[1:])
    args.argv = argv[1:]  # as typed: `ladle serve --data-parallel-size N` hands them on to each replica
    return int(importlib.import_module(SUBCOMMANDS[argv[0]][0]).run(args) or 0)


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """`ladle NAME`'s parser, with every flag its module adds (the docs' reference is read from it too)."""
    module, help_text = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"ladle {name}", description=help_text)
    importlib.import_module(module).add_arguments(parser)
    return parser


def _version() -> str:
    from ladle import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
