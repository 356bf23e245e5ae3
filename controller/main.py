"""``smetric controller --config configs/smetric.yaml``: run the routing controller."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from smetric_lmc.config import (
    ConfigError,
    LMCacheConfig,
    LoadConfig,
    ServerConfig,
    default_config_path,
    load_config,
)

log = logging.getLogger(__name__)


def _config_defaults() -> str:
    """The sockets and timeouts a config gets when it leaves them out (for --help)."""
    parts = [("server", ServerConfig()), ("load", LoadConfig()), ("lmcache", LMCacheConfig())]
    rows = [
        f"  {section}.{k}: {v}"
        for section, struct in parts
        for k, v in msgspec.structs.asdict(struct).items()
        if v is not None and not k.startswith("curve")
    ]
    return "config defaults (hosts, ports, timeouts) when the file leaves them out:\n" + "\n".join(rows)


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``controller`` subcommand to the ``smetric`` console script."""
    p = subparsers.add_parser(
        "controller",
        help="run the routing controller (route service over ZMQ, KV event ingest, metrics)",
        description=(
            "Run the SMetric routing controller. It subscribes to every instance's vLLM KV events,\n"
            "speaks the LMCache worker protocol, follows the global KV store, and answers `route`\n"
            "over ZMQ. SIGHUP (or editing the file) reloads the policy section; SIGINT/SIGTERM stop it."
        ),
        epilog=_config_defaults(),
    )
    p.add_argument("--config", default=None,
                   help="YAML config (default: the example config shipped in the package, "
                        "smetric_lmc/configs/smetric.yaml: two local vLLM instances)")
    p.add_argument(
        "--route-url", default=None, help="override server.route_url (e.g. tcp://127.0.0.1:5600)"
    )
    p.add_argument(
        "--check", metavar="CONFIG", default=None,
        help="validate CONFIG, print the resolved settings (hash roots, sockets, policy) and warnings, "
        "and exit without starting: 0 valid, 2 invalid",
    )
    p.set_defaults(func=run_controller)


def run_check(path: str) -> int:
    from smetric_lmc.controller.check import check

    try:
        lines, warns = check(load_config(path), path)
    except (ConfigError, ValueError) as exc:
        print(f"config {path}: invalid: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for w in warns:
        print(f"warning: {w}")
    return 0


def run_controller(args: argparse.Namespace) -> int:
    if getattr(args, "check", None):
        return run_check(args.check)
    if args.config is None:
        args.config = default_config_path()
        log.info("controller: no --config, using the packaged example %s", args.config)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        log.error("controller: bad config: %s", exc)
        return 2
    if getattr(args, "route_url", None):
        cfg = msgspec.structs.replace(cfg, server=msgspec.structs.replace(cfg.server, route_url=args.route_url))
    from smetric_lmc.controller.memory import exec_with_allocator, running_allocator

    exec_with_allocator(cfg.advanced.allocator)  # returns only when already running under it
    log.info("controller: allocator %s", running_allocator())
    import zmq

    from smetric_lmc import eventloop
    from smetric_lmc.controller.app import (
        ControllerApp,  # the sockets' imports are only paid when the controller runs
    )

    app = ControllerApp(cfg, config_path=args.config)
    try:
        eventloop.run(app.serve())
    except (OSError, zmq.ZMQError) as exc:  # a port already in use: one line, no traceback
        log.error("controller: cannot start: %s (server.route_url %s, server.metrics_port %s; "
                  "a stack still running? `smetric status` / `smetric down`)", exc, cfg.server.route_url,
                  cfg.server.metrics_port)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m smetric_lmc.controller.main`` without the ``smetric`` front end."""
    from smetric_lmc.cli import Parser

    parser = Parser(prog="smetric-controller")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(["controller", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
