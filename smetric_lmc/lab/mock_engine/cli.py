"""``smetric mock-engine``: N protocol-true mock vLLM engines in one asyncio process.

    smetric mock-engine --instances 4 [--profile qwen3-30b-a3b-h20] [--speed 1] [--ready-file F]

Each instance has its own HTTP port (OpenAI API, /metrics, /health, /tokenize), its own KV event
PUB socket and replay ROUTER, and its own simulated engine (``smetric_lmc.lab.mock_engine.core``).
Ports are free loopback ports unless ``--port`` gives the first of a consecutive range (HTTP ports
``port + i``; KV events ``port + 1000 + 2i``; replay ``port + 1001 + 2i``). When every instance
listens, one JSON document describing them is written to ``--ready-file`` (and stdout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from smetric_lmc.lab.mock_engine.core import MockEngineCore
from smetric_lmc.lab.mock_engine.kv_events import KVEventPublisher
from smetric_lmc.lab.mock_engine.retrieve import (
    LOCAL_CPU_PATH,
    CostsFile,
    MockClock,
    RetrieveCosts,
    SharedTiers,
)
from smetric_lmc.lab.mock_engine.server import MockEngineServer
from smetric_lmc.lab.mock_engine.store_keys import StoreKeys
from smetric_lmc.lab.sim.config import SLO
from smetric_lmc.lab.sim.fetch_path import DEFAULT_FETCH_PATH, fetch_path_names, load_fetch_path
from smetric_lmc.lab.sim.profile import DEFAULT_PROFILE, GIB, load_profile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MockInstance:
    """Where one mock engine listens: the fields ``smetric up`` puts into a controller config."""

    instance_id: str
    http_url: str
    kv_events_endpoint: str
    replay_endpoint: str
    block_size: int
    model: str
    hash_algo: str
    num_gpu_blocks: int
    max_model_len: int

    @property
    def spec(self) -> MockInstance:  # what workers.up.controller_config reads from a RunningEngine
        return self


def _ports(args: argparse.Namespace, i: int) -> tuple[int, int, int]:
    if args.port:
        return args.port + i, args.port + 1000 + 2 * i, args.port + 1001 + 2 * i
    return 0, 0, 0


def load_ready(path: Path) -> list[MockInstance]:
    """The instances a ``--ready-file`` describes."""
    data: dict[str, Any] = json.loads(path.read_text())
    return [MockInstance(**d) for d in data["instances"]]


@contextlib.asynccontextmanager
async def running_mocks(args: argparse.Namespace) -> AsyncIterator[list[tuple[MockInstance, MockEngineCore]]]:
    """Serve ``args.instances`` mock engines in this event loop until the block exits."""
    profile = load_profile(args.profile)
    host = args.host
    runners: list[web.AppRunner] = []
    out: list[tuple[MockInstance, MockEngineCore]] = []
    clock = MockClock(args.speed)
    keys = store_keys(args)
    if keys is not None:
        await keys.start()
    tiers = shared_tiers(args, profile, clock, keys)
    watcher: asyncio.Task[None] | None = None
    if args.retrieve_file:
        if tiers is None:
            raise ValueError("--retrieve-file needs a tier to fetch from (--global-gib or --local-cpu-gib)")
        watcher = asyncio.get_running_loop().create_task(CostsFile(Path(args.retrieve_file), [tiers]).watch())
    try:
        for i in range(args.instances):
            iid = f"{args.id_prefix}-{args.first_index + i}"
            http_port, kv_port, replay_port = _ports(args, i)
            pub = KVEventPublisher(f"tcp://{host}:{kv_port}", f"tcp://{host}:{replay_port}", topic=args.topic)
            core = MockEngineCore(
                iid, profile, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                max_model_len=args.max_model_len, speed=args.speed, stream_interval=args.stream_interval,
                hash_algo=args.hash_algo, none_hash_seed=args.none_hash_seed, publisher=pub, clock=clock,
                tiers=tiers.view(i) if tiers is not None else None, tpot_slo_s=args.tpot_slo_ms / 1e3)
            pub.start()
            runner = web.AppRunner(MockEngineServer(core, args.served_model_name).app(), access_log=None)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, host, http_port).start()
            port = runner.addresses[0][1]
            info = MockInstance(iid, f"http://{host}:{port}", pub.endpoint, pub.replay_endpoint or "",
                                args.block_size, args.served_model_name, args.hash_algo, core.num_gpu_blocks,
                                core.max_model_len)
            out.append((info, core))
        yield out
    finally:
        if watcher is not None:
            watcher.cancel()
        for runner in runners:
            await runner.cleanup()
        for _, core in out:
            if core.publisher is not None:
                await core.publisher.close()
        if keys is not None:
            await keys.close()


def store_keys(args: argparse.Namespace) -> StoreKeys | None:
    """The writer of the global tier's LMCache keys, when ``--global-store-keys`` asks for one."""
    if not args.global_store_keys:
        return None
    if not args.global_gib:
        raise ValueError("--global-store-keys names a global tier's chunks: give the tier a size (--global-gib)")
    return StoreKeys(args.global_store_keys, model=args.served_model_name, block_size=args.block_size,
                     root=args.lmcache_root, algo=args.lmcache_hash)


def shared_tiers(args: argparse.Namespace, profile: Any, clock: MockClock,
                 keys: StoreKeys | None = None) -> SharedTiers | None:
    """The process's global tier and its instances' local CPU tiers, as the options say (None when
    neither is asked for: vLLM engines alone, no LMCache)."""
    if args.global_gib < 0 or args.local_cpu_gib < 0:
        raise ValueError("--global-gib and --local-cpu-gib must be >= 0")
    if not args.global_gib and not args.local_cpu_gib:
        return None
    bpb = args.block_size * profile.kv_bytes_per_token
    costs = RetrieveCosts(load_fetch_path(args.fetch_path), load_fetch_path(args.local_fetch_path))
    # Explicit numbers override the profiles' (as POST /mock/retrieve would).
    change: dict[str, dict[str, float]] = {}
    for tier, prefix in (("global", "retrieve"), ("local_cpu", "local")):
        for key in ("gbps", "chunk_ms", "lookup_ms"):
            v = getattr(args, f"{prefix}_{key}")
            if v is not None:
                change.setdefault(tier, {})[key] = v
    costs = costs.updated(change)
    return SharedTiers(profile, args.block_size, args.instances, clock,
                       global_blocks=int(args.global_gib * GIB // bpb),
                       local_cpu_blocks=int(args.local_cpu_gib * GIB // bpb), costs=costs, keys=keys)


def options(**overrides: Any) -> argparse.Namespace:
    """The command's defaults with ``overrides``: for starting mocks from Python."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args([])
    for k, v in overrides.items():
        if not hasattr(args, k):
            raise TypeError(f"unknown mock-engine option {k!r}")
        setattr(args, k, v)
    return args


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    async with running_mocks(args) as mocks:
        doc = json.dumps({"instances": [asdict(m) for m, _ in mocks], "profile": args.profile, "speed": args.speed})
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            tmp.write_text(doc)
            tmp.replace(args.ready_file)
        print(doc, flush=True)
        log.info("mock engines up: %d instances (%s, speed %g, %d KV blocks each)", len(mocks), args.profile,
                 args.speed, mocks[0][1].num_gpu_blocks if mocks else 0)
        await stop.wait()


def run_mock_engine(args: argparse.Namespace) -> int:
    if args.instances < 1:
        log.error("mock-engine: --instances must be >= 1")
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    try:
        asyncio.run(main())
    except (OSError, ValueError, RedisError) as exc:
        log.error("mock-engine failed: %s", exc)
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=1, help="engines served by this process")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="first HTTP port (0: free ports)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="simulator profile name or YAML path")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV capacity override (default: the profile's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--speed", type=float, default=1.0, help="model time per wall second")
    p.add_argument("--stream-interval", type=int, default=4,
                   help="decode steps between stream deliveries (and scheduler wake-ups)")
    p.add_argument("--hash-algo", default="sha256_cbor", choices=("sha256_cbor",),
                   help="vLLM --prefix-caching-hash-algo (the mock implements sha256_cbor)")
    p.add_argument("--none-hash-seed", default="0", help="vLLM's NONE_HASH seed (PYTHONHASHSEED of the engines)")
    p.add_argument("--tpot-slo-ms", type=float, default=1e3 * SLO().tpot_s,
                   help="the TPOT SLO the engines' own accounting counts against (/mock/stats slow_tpot_tokens)")
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--topic", default="kv")
    p.add_argument("--id-prefix", default="mock")
    p.add_argument("--first-index", type=int, default=0)
    p.add_argument("--ready-file", default=None, help="write the instances' JSON here once all listen")
    t = p.add_argument_group("KV tiers beyond the GPU (LMCache): off unless a size is given")
    t.add_argument("--global-gib", type=float, default=0.0,
                   help="global tier shared by this process's instances, GiB (0: none)")
    t.add_argument("--local-cpu-gib", type=float, default=0.0, help="local CPU tier per instance, GiB (0: none)")
    names = fetch_path_names()
    t.add_argument("--fetch-path", default=DEFAULT_FETCH_PATH, choices=names,
                   help="(default: %(default)s) global tier's retrieve path: a simulator fetch-path profile (configs/fetch_paths.yaml)")
    t.add_argument("--local-fetch-path", default=LOCAL_CPU_PATH, choices=names,
                   help="(default: %(default)s) local CPU tier's retrieve path (a fetch-path profile)")
    t.add_argument("--retrieve-gbps", type=float, default=None,
                   help="global tier: per-request retrieve throughput, GB/s (0: links only; default: the profile's)")
    t.add_argument("--retrieve-chunk-ms", type=float, default=None, help="global tier: cost per 256-token chunk, ms")
    t.add_argument("--retrieve-lookup-ms", type=float, default=None, help="global tier: lookup per request, ms")
    t.add_argument("--local-gbps", type=float, default=None, help="local CPU tier: per-request throughput, GB/s")
    t.add_argument("--local-chunk-ms", type=float, default=None, help="local CPU tier: cost per chunk, ms")
    t.add_argument("--local-lookup-ms", type=float, default=None, help="local CPU tier: lookup, ms")
    t.add_argument("--retrieve-file", default=None,
                   help="JSON file of retrieve-cost changes, re-read whenever it changes (as POST /mock/retrieve)")
    t.add_argument("--global-store-keys", default=None, metavar="REDIS_URL",
                   help="name the global tier's chunks in this Redis as LMCache's redis connector does "
                        "(keys only), so a controller with global_store kind redis sees the tier")
    t.add_argument("--lmcache-hash", default="builtin", choices=("builtin", "sha256_cbor"),
                   help="(default: %(default)s) LMCache chunk hash of those keys (the controller's hashing.lmcache_hash)")
    t.add_argument("--lmcache-root", type=int, default=0,
                   help="(default: %(default)s) LMCache chunk chain root (the controller's hashing.lmcache_root)")


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("mock-engine", help="protocol-true mock vLLM engines driven by the simulator's model",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_mock_engine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="smetric mock-engine", description=__doc__)
    add_arguments(ap)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_mock_engine(ap.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

