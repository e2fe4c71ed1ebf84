"""`epdraft` command line: parses, then calls the module that owns the command.

Each command module exposes `add_arguments(parser)` and `main(args) -> int` (the exit code);
nothing here knows how a command works.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

from epdraft.errors import EpdraftError, Interrupted, RankFailed

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_HELP = f"logging level: {', '.join(LOG_LEVELS)} (default INFO)"
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("epdraft.run", "run speculative decoding end to end (the main job)"),
    "launch": ("epdraft.launch", "launch the worker ranks of a config through torchrun"),
    "check": ("epdraft.check", "print the per-layer FFN plan of a draft config or directory"),
    "plan": ("epdraft.dispatch.planner", "choose the MoE layout for a config and a draft"),
    "bench": ("epdraft.bench", "benchmarks: dispatch, iteration, kernel, linear, step, sync, transfer"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported, so one command's dependencies never break another."""
    parser = argparse.ArgumentParser(prog="epdraft", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    parser.add_argument("--log-level", default="INFO", help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text)
        # The same flag after the command; SUPPRESS keeps a value given before it when none is given after.
        cmd.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
        if name == command:
            module = importlib.import_module(module_name)
            cmd.description = module.__doc__
            module.add_arguments(cmd)
            cmd.set_defaults(_main=module.main)
    return parser


class _Version(argparse.Action):
    """`--version`: `epdraft <version>` from the installed package's metadata, read only when asked."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        try:
            version = importlib.metadata.version("epdraft")
        except importlib.metadata.PackageNotFoundError:
            parser.exit(2, "epdraft --version: epdraft is not installed (no package metadata); pip install -e .\n")
        print(f"epdraft {version}")  # stdout, as argparse's own version action
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(next((a for a in argv if a in COMMANDS), None)).parse_args(argv)
    level = args.log_level.upper()
    if level not in LOG_LEVELS:
        print(f"epdraft {args.command}: --log-level {args.log_level}: expected one of {', '.join(LOG_LEVELS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args._main(args)
    except Interrupted as e:
        print(f"epdraft {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except RankFailed as e:  # a rank's own one-line reason, printed once for all ranks
        print(f"epdraft {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any rank started (while checking inputs)
        print(f"epdraft {args.command}: interrupted by SIGINT", file=sys.stderr)
        return 130
    except EpdraftError as e:
        print(f"epdraft {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
