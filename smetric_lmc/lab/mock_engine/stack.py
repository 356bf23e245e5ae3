"""Mock engines as child processes, and ``smetric up --mock N`` (mock engines + controller + gateway).

Many instances share one asyncio process (``--mock-processes`` spreads them over several); each
process writes a ready file listing its instances, which is how the controller config is built.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from smetric_lmc.lab.mock_engine.cli import MockInstance, load_ready
from smetric_lmc.lab.mock_engine.tokenizer_dir import write_tokenizer_dir
from smetric_lmc.workers import launch, up


class _SharedProcess:
    """The process an instance lives in, as ``LocalStack`` sees an engine's: polled, stopped elsewhere."""

    def __init__(self, group: launch.ProcessGroup) -> None:
        self.group = group
        self.log_path = group.log_path

    def poll(self) -> int | None:
        return self.group.poll()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        return self.group.poll()  # the group is in the stack's processes and stopped there


class MockEngineHandle:
    """A mock instance in the shape ``LocalStack`` keeps its engines."""

    def __init__(self, info: MockInstance, group: launch.ProcessGroup) -> None:
        self.info = info
        self.process = _SharedProcess(group)
        self.model = info.model
        self.instance_id = info.instance_id
        self.http_url = info.http_url


def start_mock_engines(
    n: int, log_dir: Path, *, processes: int = 1, extra_args: Sequence[str] = (), timeout_s: float = 60.0,
) -> list[tuple[MockInstance, launch.ProcessGroup]]:
    """Start ``n`` mock instances over ``processes`` child processes; returns once all listen, each
    instance with the process serving it."""
    if n < 1 or processes < 1:
        raise ValueError("need at least one instance and one process")
    processes = min(processes, n)
    groups: list[launch.ProcessGroup] = []
    ready: list[Path] = []
    first = 0
    try:
        for p in range(processes):
            k = n // processes + (1 if p < n % processes else 0)
            path = log_dir / f"mock-{p}.ready.json"
            path.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "smetric_lmc.cli", "mock-engine", "--instances", str(k),
                    "--first-index", str(first), "--ready-file", str(path), *extra_args]
            g = launch.ProcessGroup(argv, dict(os.environ), log_dir / f"mock-{p}.log", f"mock-engine-{p}")
            g.start()
            groups.append(g)
            ready.append(path)
            first += k
        deadline = time.monotonic() + timeout_s
        for g, path in zip(groups, ready):
            while not path.exists():
                rc = g.poll()
                if rc is not None or time.monotonic() > deadline:
                    why = f"exited with {rc}" if rc is not None else f"not up after {timeout_s:.0f} s"
                    raise RuntimeError(f"{g.name} {why}; log tail:\n{launch.tail_file(g.log_path)}")
                time.sleep(0.1)
        return [(m, g) for g, path in zip(groups, ready) for m in load_ready(path)]
    except BaseException:
        for g in groups:
            g.stop()
        raise


def bring_up_mock(args: argparse.Namespace, workdir: Path, *, policy_overrides: dict[str, Any] | None = None,
                  metrics_poll_s: float = 1.0, route_timeout_s: float | None = None) -> up.LocalStack:
    """``smetric up --mock N``: mock engines, then the controller and the gateway for them.
    ``route_timeout_s``: the gateway's wait for a decision (its default when None)."""
    extra = shlex.split(getattr(args, "mock_args", "") or "")
    processes = getattr(args, "mock_processes", 1)
    store, store_url = _global_store(args, workdir, processes)
    if store_url:
        extra += ["--global-gib", str(args.mock_global_gib), "--global-store-keys", store_url]
    try:
        started = start_mock_engines(args.mock, workdir, processes=processes, extra_args=extra)
    except BaseException:
        if store is not None:
            store.stop()
        raise
    infos = [i for i, _ in started]
    groups = list({id(g): g for _, g in started}.values()) + ([store.process] if store is not None else [])
    engines = [MockEngineHandle(i, g) for i, g in started]
    # Free ports are picked only now: the mock engines' own ports are taken by then (picking before
    # they start could hand the gateway a port one of them binds a moment later).
    port = args.port or launch.free_ports(1)[0]
    stack = up.LocalStack(engines, workdir / "smetric.yaml", f"http://{args.host}:{port}", "",  # type: ignore[arg-type]
                          processes=list(groups), policy=args.policy, engine_kind="mock engine")
    try:
        route_port = getattr(args, "route_port", 0) or launch.free_ports(1)[0]
        metrics_port = getattr(args, "metrics_port", 0) or launch.free_ports(1)[0]
        stack.route_url = f"tcp://127.0.0.1:{route_port}"
        cfg = up.controller_config(infos, route_url=stack.route_url,  # type: ignore[arg-type]
                                   metrics_port=metrics_port, policy=args.policy,
                                   policy_overrides=policy_overrides, metrics_poll_s=metrics_poll_s)
        if store_url:
            cfg["global_store"] = {"kind": "redis", "url": store_url}
        up.write_config(cfg, stack.config_path)
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        stack.processes.append(up.start_controller(stack.config_path, metrics_port, workdir))
        extra = ["--route-timeout-s", str(route_timeout_s)] if route_timeout_s else []
        stack.processes.append(up.start_gateway(stack.config_path, port, workdir, host=args.host, extra_args=extra,
                                                tokenizer=_tokenizer_dir(workdir)))
    except BaseException:
        stack.stop()
        raise
    return stack


def _global_store(args: argparse.Namespace, workdir: Path, processes: int) -> tuple[launch.GlobalStore | None, str]:
    """``--mock-global-gib``: a redis-server where the mock names its global tier's chunks (as
    LMCache's redis connector does) and the controller follows them; (None, "") without it."""
    gib = getattr(args, "mock_global_gib", 0.0) or 0.0
    if not gib:
        return None, ""
    if processes != 1:
        raise ValueError("--mock-global-gib: the instances of one mock process share its global tier; "
                         "run them in one (--mock-processes 1)")
    store = launch.start_global_store("redis", log_dir=workdir)
    return store, f"redis://{store.address}/0"


def _tokenizer_dir(workdir: Path) -> Path | None:
    """The mock's tokenizer as a directory for the gateway (local tokenizing, as with vLLM and
    --tokenizer); None without the `tokenizer` extra: the gateway then asks the engines' /tokenize."""
    if importlib.util.find_spec("tokenizers") is None or importlib.util.find_spec("jinja2") is None:
        return None
    return write_tokenizer_dir(workdir / "tokenizer")

