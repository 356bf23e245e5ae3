"""``smetric up``: a whole local stack — N vLLM CPU engines, the controller, the gateway.

    smetric up --engines 2 [--policy smetric] [--port 8080] [--metrics-port 9600]

Builds (once) the engine venv and the tiny test model, starts the engines with KV events and
prefix caching on, writes a controller config for them, starts ``smetric controller`` and
``smetric gateway`` as child processes, prints a banner (every URL, the config, each part's
log), and supervises them: a part that exits is restarted with backoff while the rest keep serving
(``supervise.py``; the controller routes around a restarting engine). SIGINT (also when started in
the background, where a shell leaves SIGINT ignored) and SIGTERM stop everything, each part's
whole process group included. The ports are fixed (the defaults below, 0 picks a free one) and
checked before the minutes-long engine start-up.
The pieces (config, process start-up) are reused by the end-to-end tests.

``smetric status`` and ``smetric down`` find a running stack through the state file ``up`` writes
(``~/.cache/smetric/run/up-<gateway port>.json``, ``SMETRIC_STATE_DIR`` moves it): ``down`` asks
``smetric up`` to stop, then ends every process group it started — also after ``kill -9`` of
``smetric up``, by the ``SMETRIC_UP_ID`` each child inherits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import yaml

from smetric_lmc.config import POLICY_NAMES, ServerConfig
from smetric_lmc.workers import launch
from smetric_lmc.workers.supervise import Part, Supervisor

log = logging.getLogger(__name__)


def controller_config(
    engines: Sequence[launch.RunningEngine],
    *,
    route_url: str,
    metrics_port: int,
    policy: str = "smetric",
    policy_overrides: dict[str, Any] | None = None,
    metrics_poll_s: float = 1.0,
    load_overrides: dict[str, Any] | None = None,
    model: str | None = None,
    snapshot_path: Path | None = None,
) -> dict[str, Any]:
    """A controller config (as YAML-ready data) for running engines: events, metrics, endpoints."""
    if not engines:
        raise ValueError("no engines")
    block_sizes = {e.block_size for e in engines}
    if len(block_sizes) != 1:
        raise ValueError(f"engines disagree on block size: {sorted(block_sizes)}")
    return {
        "model": model or engines[0].model,
        "policy": {"name": policy, **(policy_overrides or {})},
        "hashing": {"block_size": block_sizes.pop()},
        "instances": [
            {"id": e.instance_id, "http": e.http_url, "kv_events": e.kv_events_endpoint, "replay": e.replay_endpoint}
            for e in engines
        ],
        "server": {"route_url": route_url, "metrics_port": metrics_port},
        "load": {"metrics_poll_s": metrics_poll_s, **(load_overrides or {})},
        **({"snapshot": {"path": str(snapshot_path)}} if snapshot_path is not None else {}),
    }


def write_config(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write beside and rename: the controller watches this file for policy hot-reloads.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)
    return path


def _answers(url: str) -> bool:
    """True when anything answers HTTP at ``url`` (503 included: the server is up)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _start_service(argv: list[str], name: str, log_dir: Path, ready_url: str, timeout_s: float) -> launch.ProcessGroup:
    proc = launch.ProcessGroup(argv, dict(os.environ), log_dir / f"{name}.log", name)
    proc.start()
    deadline = time.monotonic() + timeout_s
    while not _answers(ready_url):
        rc = proc.poll()
        if rc is not None or time.monotonic() > deadline:
            proc.stop()
            why = f"exited with {rc}" if rc is not None else f"not up after {timeout_s:.0f} s"
            raise RuntimeError(f"{name} {why}; log tail:\n{launch.tail_file(proc.log_path)}")
        time.sleep(0.2)
    return proc


def start_controller(config_path: Path, metrics_port: int, log_dir: Path, timeout_s: float = 30.0) -> launch.ProcessGroup:
    """``smetric controller --config`` as a child process group; returns once /healthz answers."""
    argv = [sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(config_path)]
    return _start_service(argv, "controller", log_dir, f"http://127.0.0.1:{metrics_port}/healthz", timeout_s)


def start_gateway(
    config_path: Path,
    port: int,
    log_dir: Path,
    *,
    host: str = "127.0.0.1",
    tokenizer: Path | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = 30.0,
) -> launch.ProcessGroup:
    """``smetric gateway`` as a child process group; returns once its /healthz answers."""
    argv = [sys.executable, "-m", "smetric_lmc.cli", "gateway", "--config", str(config_path),
            "--host", host, "--port", str(port), *extra_args]
    if tokenizer is not None:
        argv += ["--tokenizer", str(tokenizer)]
    return _start_service(argv, "gateway", log_dir, f"http://{host}:{port}/healthz", timeout_s)


@dataclass
class LocalStack:
    engines: list[launch.RunningEngine]
    config_path: Path
    gateway_url: str
    metrics_url: str  # the controller's /metrics
    processes: list[launch.ProcessGroup] = field(default_factory=list)
    route_url: str = ""
    policy: str = ""
    engine_kind: str = "vLLM engine"  # what the banner calls the engines

    def stop(self) -> None:
        # Front to back: no new requests reach engines that are going away.
        for proc in reversed(self.processes):
            proc.stop(timeout_s=10.0)
        for e in self.engines:
            e.process.stop()


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Fail now, not after minutes of engine start-up, when a fixed port is taken."""
    taken = []
    for name, port in ports.items():
        if port == 0:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the servers bind: connections of a stopped stack left in TIME-WAIT do not block.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host if name == "gateway" else "127.0.0.1", port))
            except OSError as exc:
                taken.append(f"{name} port {port} ({exc.strerror})")
    if taken:
        raise RuntimeError("cannot use " + ", ".join(taken) + "; a stack still running? `smetric status` shows it, "
                           "`smetric down` stops it; or choose other ports with --port / --metrics-port / "
                           "--route-port (0: any free port)")


def _pick(port: int) -> int:
    return port or launch.free_ports(1)[0]


#: Entry-point group of engine stacks other than real vLLM (the lab's mock engines register
#: ``mock`` in pyproject.toml): the launcher finds them by name and never imports the lab.
STACK_GROUP = "smetric_lmc.stacks"


def stack_plugin(name: str) -> Callable[[argparse.Namespace, Path], LocalStack]:
    """The installed stack ``name`` (a function bringing it up), or a clear exit when none is."""
    found = entry_points(group=STACK_GROUP, name=name)
    if not found:
        raise SystemExit(f"no '{name}' engine stack installed (entry point group {STACK_GROUP}); "
                         "reinstall smetric-lmc (pip install -e .)")
    return next(iter(found)).load()  # type: ignore[no-any-return]


def bring_up(args: argparse.Namespace, workdir: Path) -> LocalStack:
    if getattr(args, "mock", 0):
        return stack_plugin("mock")(args, workdir)
    venv = launch.ensure_engine_venv()
    python = launch.engine_python(venv)
    model = Path(args.model) if args.model else launch.build_tiny_model(
        venv.parent / "models" / "tiny-qwen2", python=python)
    specs = launch.cpu_test_specs(args.engines, model, python=python,
                                  block_size=args.block_size, max_model_len=args.max_model_len)
    log.info("starting %d vLLM engines (30-50 s each on CPU); logs in %s", len(specs), workdir)
    engines = launch.start_engines(specs, workdir, timeout_s=args.engine_timeout_s)
    port = _pick(args.port)
    stack = LocalStack(engines, workdir / "smetric.yaml", f"http://{args.host}:{port}", "", policy=args.policy)
    try:
        route_port, metrics_port = _pick(args.route_port), _pick(args.metrics_port)
        stack.route_url = f"tcp://127.0.0.1:{route_port}"
        # A snapshot beside the config: a restarted controller reloads its index and replays.
        cfg = controller_config(engines, route_url=stack.route_url, metrics_port=metrics_port, policy=args.policy,
                                snapshot_path=workdir / "index.snap")
        write_config(cfg, stack.config_path)
        stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        stack.processes.append(start_controller(stack.config_path, metrics_port, workdir))
        # The model's own tokenizer, read here (tokenizers + jinja2, or transformers), when this
        # interpreter can; else the engines' /tokenize, a round trip per request.
        local = all(importlib.util.find_spec(m) for m in ("tokenizers", "jinja2")) \
            or importlib.util.find_spec("transformers") is not None
        tok = model if local else None
        stack.processes.append(start_gateway(stack.config_path, port, workdir, host=args.host, tokenizer=tok))
    except BaseException:
        stack.stop()
        raise
    return stack


def banner(stack: LocalStack) -> str:
    """What `smetric up` prints once everything answers: where to send requests, look, and read logs."""
    model = stack.engines[0].model if stack.engines else "?"
    health = stack.metrics_url.removesuffix("/metrics") + "/healthz"
    procs = {p.name: p.log_path for p in stack.processes}
    width = max([len(e.instance_id) for e in stack.engines] + [len("controller")])
    lines = [
        f"smetric up: {len(stack.engines)} {stack.engine_kind}(s), policy {stack.policy or '?'}, model {model!r}",
        f"  gateway     {stack.gateway_url}/v1  (OpenAI-compatible)",
        f"  metrics     gateway {stack.gateway_url}/metrics",
        f"              controller {stack.metrics_url}  (health: {health})",
        f"  route       {stack.route_url}  (ZMQ; smetric_lmc.client.RouteClient)",
        f"  config      {stack.config_path}",
        "  logs",
    ]
    for e in stack.engines:
        lines.append(f"    {e.instance_id:<{width}}  {e.process.log_path}  (engine {e.http_url})")
    for name in ("controller", "gateway"):
        if name in procs:
            lines.append(f"    {name:<{width}}  {procs[name]}")
    lines += [
        "  Until the engines' first KV events reach the controller, requests are balanced by load and",
        "  answered with X-SMetric-Index-Ready: false; X-SMetric-Reason says why each request went where.",
        "A part that exits is restarted; Ctrl-C (or `smetric down`) stops everything; `smetric status` shows it.",
    ]
    return "\n".join(lines)


class _Stop(Exception):
    pass


class _StopSignal:
    """SIGINT/SIGTERM handler: aborts a bring-up by raising, but only records a signal afterwards.

    An exception raised from a signal handler lands between any two bytecodes; inside
    ``Popen.poll`` it can leave the Popen's wait lock held, and the stop that follows then waits
    on it forever. Once the stack is up, the supervision loop polls ``requested`` instead.
    """

    def __init__(self) -> None:
        self.requested: str | None = None
        self.raising = True

    def __call__(self, signum: int, _frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        if self.raising:
            self.raising = False  # once: a second signal must not interrupt the cleanup
            raise _Stop(self.requested)


def supervisor(stack: LocalStack, **kw: Any) -> Supervisor:
    """Every engine and service of ``stack`` as a restartable part; restarts update the stack."""
    parts = []
    for i, e in enumerate(stack.engines):
        def swap_engine(new: launch.ProcessGroup, i: int = i) -> None:
            stack.engines[i].process = new  # type: ignore[assignment]
        parts.append(Part(e.process, swap_engine))
    for i, proc in enumerate(stack.processes):
        def swap(new: launch.ProcessGroup, i: int = i) -> None:
            stack.processes[i] = new
        parts.append(Part(proc, swap))
    return Supervisor(parts, **kw)


# ---- the state file: how `smetric status` / `smetric down` find a running stack ------------------
UP_ID_ENV = "SMETRIC_UP_ID"


def state_dir() -> Path:
    return Path(os.environ.get("SMETRIC_STATE_DIR", Path.home() / ".cache" / "smetric" / "run"))


def _state_path(port: int) -> Path:
    return state_dir() / f"up-{port}.json"


def write_state(path: Path, up_id: str, workdir: Path, stack: LocalStack | None, ports: dict[str, int]) -> None:
    data: dict[str, Any] = {"pid": os.getpid(), "up_id": up_id, "workdir": str(workdir), "ports": ports,
                            "started": time.time()}
    if stack is not None:
        data |= {
            "gateway_url": stack.gateway_url, "metrics_url": stack.metrics_url, "route_url": stack.route_url,
            "config": str(stack.config_path), "policy": stack.policy,
            "engines": [e.instance_id for e in stack.engines],
            "groups": {p.name: p.pid for p in _groups(stack) if p.pid is not None},
            "ipc": [str(e.process.ipc_path) for e in stack.engines if getattr(e.process, "ipc_path", None)],
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _groups(stack: LocalStack) -> list[launch.ProcessGroup]:
    out = [e.process for e in stack.engines if isinstance(e.process, launch.ProcessGroup)]
    return out + list(stack.processes)


def run_up(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="smetric-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # Both explicitly: a shell starts background jobs with SIGINT ignored, and Python then never
    # turns SIGINT into KeyboardInterrupt.
    on_signal = _StopSignal()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack: LocalStack | None = None
    # Every child inherits this mark, so `smetric down` finds them even if this process is killed.
    up_id = os.environ.setdefault(UP_ID_ENV, uuid.uuid4().hex)
    ports = {"gateway": args.port, "metrics": args.metrics_port, "route": args.route_port}
    state: Path | None = None
    try:
        check_ports(args.host, ports)
        state = _state_path(args.port)
        write_state(state, up_id, workdir, None, ports)
        stack = bring_up(args, workdir)
        on_signal.raising = False
        if on_signal.requested:  # it came as bring_up returned
            raise _Stop(on_signal.requested)
        write_state(state, up_id, workdir, stack, ports)
        print(banner(stack), flush=True)
        sup = supervisor(stack)
        while not on_signal.requested:
            if sup.check():
                write_state(state, up_id, workdir, stack, ports)  # restarted parts have new groups
            time.sleep(0.5)
        raise _Stop(on_signal.requested)
    except (KeyboardInterrupt, _Stop):
        log.info("stopping the stack")
        return 0
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:  # EngineStartError included
        log.error("smetric up failed: %s", exc)
        return 1
    finally:
        with contextlib.suppress(KeyboardInterrupt, _Stop):
            if stack is not None:
                stack.stop()
            if state is not None:
                state.unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _marked_groups(up_id: str) -> set[int]:
    """Process groups of every process carrying ``SMETRIC_UP_ID=up_id`` (Linux /proc)."""
    mark = f"{UP_ID_ENV}={up_id}".encode()
    own = os.getpgrp()
    groups = set()
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in env.read_bytes().split(b"\0"):
                pgid = os.getpgid(int(env.parent.name))
                if pgid != own:
                    groups.add(pgid)
        except (OSError, ValueError):
            continue  # exited meanwhile, or not ours to read
    return groups


def group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (an orphan's new parent, a container's
    init, may reap late: a zombie holds no port and needs no signal)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def _states(port: int | None) -> list[tuple[Path, dict[str, Any]]]:
    paths = [_state_path(port)] if port is not None else sorted(state_dir().glob("up-*.json"))
    out = []
    for p in paths:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def stop_stack(state: dict[str, Any], timeout_s: float = 30.0) -> list[int]:
    """Stop the stack ``state`` describes: SIGTERM ``smetric up`` (it stops its parts), then every
    process group it started, SIGKILL after ``timeout_s``. Returns the groups that had to be ended."""
    pid = int(state.get("pid", 0))
    if pid > 0 and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    groups = {int(g) for g in state.get("groups", {}).values()} | _marked_groups(str(state.get("up_id", "")))
    groups = {g for g in groups if g > 1 and g != os.getpgrp() and _group_alive(g)}
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    for g in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    for ipc in state.get("ipc", []):
        Path(ipc).unlink(missing_ok=True)
    return sorted(groups)


def run_down(args: argparse.Namespace) -> int:
    states = _states(args.port)
    if not states:
        print(f"smetric down: no running stack (no state file in {state_dir()})")
        return 0
    for path, st in states:
        was = "running" if _alive(int(st.get("pid", 0))) else "gone (killed?)"
        ended = stop_stack(st, timeout_s=args.timeout_s)
        path.unlink(missing_ok=True)
        left = f"; ended {len(ended)} leftover process group(s) {ended}" if ended else ""
        print(f"smetric down: stopped the stack of gateway port {st.get('ports', {}).get('gateway')} "
              f"(smetric up pid {st.get('pid')} {was}){left}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    """Exit 0 when a stack runs, 3 when none does (as ``systemctl status``)."""
    states = _states(args.port)
    if not states:
        print(f"smetric status: no stack running (no state file in {state_dir()})")
        return 3
    running = False
    for _path, st in states:
        pid = int(st.get("pid", 0))
        up_alive = _alive(pid)
        groups = {name: int(g) for name, g in st.get("groups", {}).items()}
        leftover = _marked_groups(str(st.get("up_id", "")))
        running |= up_alive or bool(leftover)
        age = time.time() - float(st.get("started", time.time()))
        print(f"stack on gateway port {st.get('ports', {}).get('gateway')}: smetric up pid {pid} "
              f"{'running' if up_alive else 'NOT running'} for {age:.0f} s, workdir {st.get('workdir')}")
        if "gateway_url" not in st:
            print("  starting (engines not all up yet)")
        else:
            gw, metrics = st["gateway_url"], st["metrics_url"]
            print(f"  gateway     {gw}/v1  {'answers' if _answers(gw + '/healthz') else 'does not answer'}"
                  f"  (status page {gw}/)")
            print(f"  controller  {metrics}  {'answers' if _answers(metrics) else 'does not answer'}")
            print(f"  policy      {st.get('policy')}, engines {', '.join(st.get('engines', []))}")
            for name, g in groups.items():
                print(f"    {name:<16} process group {g}: {'alive' if _group_alive(g) else 'exited'}")
        if not up_alive and leftover:
            print(f"  {len(leftover)} process group(s) of this stack outlived smetric up: `smetric down` ends them")
    return 0 if running else 3


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``up`` subcommand to the ``smetric`` console script."""
    p = subparsers.add_parser("up", help="run a local stack: N vLLM CPU engines + controller + gateway",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--engines", type=int, default=2, help="vLLM engines to start (each ~3 GB RAM)")
    p.add_argument("--policy", choices=POLICY_NAMES, default="smetric")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8080, help="gateway port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=ServerConfig().metrics_port,
                   help="controller /metrics and /healthz port (0: any free port)")
    p.add_argument("--route-port", type=int, default=5600, help="controller route socket port (0: any free port)")
    p.add_argument("--model", default=None, help="model dir to serve (default: build the tiny test model)")
    p.add_argument("--block-size", type=int, default=32, help="vLLM --block-size (CPU prefers multiples of 32)")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM --max-model-len (default: 2048 on CPU)")
    p.add_argument("--engine-timeout-s", type=float, default=300.0, help="wait this long for each engine's /health")
    p.add_argument("--workdir", default=None, help="config and logs (default: a new temp dir)")
    p.add_argument("--mock", type=int, default=0, metavar="N",
                   help="N mock engines (smetric mock-engine: the simulator's engine model) instead of vLLM")
    p.add_argument("--mock-processes", type=int, default=1, help="processes the mock engines share")
    p.add_argument("--mock-args", default="", help="extra `smetric mock-engine` options, e.g. '--speed 10'")
    p.add_argument("--mock-global-gib", type=float, default=0.0, metavar="GIB",
                   help="give the mock engines a shared global tier of this size, named in a redis-server the "
                        "controller follows (global_store kind redis), as with LMCache's redis connector")
    p.set_defaults(func=run_up)


def add_down_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("down", help="stop a stack `smetric up` started, every process it started included",
                              description="Stops a running `smetric up` (SIGTERM), then ends every process group it "
                                          "started, also after `kill -9` of `smetric up`.")
    p.add_argument("--port", type=int, default=None, help="only the stack with this gateway port (default: all)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="wait this long for a graceful stop, then SIGKILL")
    p.set_defaults(func=run_down)


def add_status_subcommand(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("status", help="show a stack `smetric up` started: URLs, parts, whether they answer",
                              description="Exit status 0 when a stack runs, 3 when none does.")
    p.add_argument("--port", type=int, default=None, help="only the stack with this gateway port (default: all)")
    p.set_defaults(func=run_status)
