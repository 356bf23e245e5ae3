"""The ``smetric`` console script: one entry, one subcommand per part of the system."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from smetric_lmc.config import ConfigError

# subcommand -> (module, function adding its argparse subcommand); imported lazily so that
# `smetric sim` does not pay for the controller's sockets or the gateway's HTTP stack.
_PARTS = {
    "sim": ("smetric_lmc.lab.replay.sim_cli", "add_sim_subcommands"),
    "trace": ("smetric_lmc.lab.sim.trace_cli", "add_trace_subcommands"),
    "controller": ("smetric_lmc.controller.main", "add_subcommands"),
    "gateway": ("smetric_lmc.gateway", "add_subcommands"),
    "up": ("smetric_lmc.workers.up", "add_subcommands"),
    "status": ("smetric_lmc.workers.up", "add_status_subcommand"),
    "down": ("smetric_lmc.workers.up", "add_down_subcommand"),
    "mock-engine": ("smetric_lmc.lab.mock_engine.cli", "add_subcommands"),
    "replay": ("smetric_lmc.lab.replay.cli", "add_subcommands"),
    "router": ("smetric_lmc.dropin.router", "add_subcommands"),
}


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and ends every option's help with its default.

    Options whose help already names its default, flags, and options without a default (None)
    are left as they are.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not _has_default(default)
            or "default" in text.lower()
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        return f"{text} (default: {shown})".lstrip()


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its subcommands' parsers are of this class too
    (argparse makes sub-parsers of the parent's class), so every `smetric ... --help` does."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        if kw.get("formatter_class") in (None, argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter):
            kw["formatter_class"] = DefaultsHelpFormatter
        super().__init__(*args, **kw)

    def add_argument(self, *args: Any, **kw: Any) -> argparse.Action:
        action = super().add_argument(*args, **kw)
        # argparse prints no help line at all for an option without help text: give it one so
        # that its default still shows.
        if not action.help and action.option_strings and _has_default(action.default):
            action.help = "(default: %(default)s)"
        return action


def _has_default(default: Any) -> bool:
    return default is not None and default is not False and default is not argparse.SUPPRESS


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="smetric", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, adder) in _PARTS.items():
        if wanted not in (None, name):
            sub.add_parser(name, help=f"(see `smetric {name} --help`)")
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            p = sub.add_parser(name, help=f"unavailable: {exc}")
            p.set_defaults(func=lambda _a, exc=exc, name=name: _unavailable(name, exc))
            continue
        getattr(mod, adder)(sub)
    return parser


def _unavailable(name: str, exc: Exception) -> int:
    print(f"smetric {name}: unavailable ({exc})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "func", None) is None:
        if args.command is None:
            args = parser.parse_args(["sim"])  # the main job on the embedded default
        else:
            parser.parse_args([args.command, "--help"])
            return 2
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ConfigError) as exc:
        # A user's wrong path or value: one line naming it (-v: with the traceback).
        if args.verbose:
            raise
        if isinstance(exc, OSError):
            what = f"{exc.strerror or 'not found'}: {exc.filename or exc}"
        else:
            what = str(exc)
        print(f"smetric {args.command or 'sim'}: {what}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
