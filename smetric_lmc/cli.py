"""The ``smetric`` console script: one entry, one subcommand per part of the system."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, function adding its argparse subcommand); imported lazily so that
# `smetric sim` does not pay for the controller's sockets or the gateway's HTTP stack.
_PARTS = {
    "sim": ("smetric_lmc.sim.cli", "add_subcommands"),
    "trace": ("smetric_lmc.workload.cli", "add_trace_subcommands"),
    "controller": ("smetric_lmc.controller.main", "add_subcommands"),
    "gateway": ("smetric_lmc.gateway", "add_subcommands"),
    "up": ("smetric_lmc.workers.up", "add_subcommands"),
    "mock-engine": ("smetric_lmc.mock_engine.cli", "add_subcommands"),
    "replay": ("smetric_lmc.replay.cli", "add_subcommands"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="smetric", description=__doc__)
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
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
