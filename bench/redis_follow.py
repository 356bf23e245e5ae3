"""What following a Redis global tier costs the controller: CPU per keyspace notification.

    python bench/redis_follow.py                 # 20,000 chunks (40,000 notifications), 3 rounds each way

LMCache's redis connector writes two keys per chunk, so the controller's Redis adapter
(``controller/global_redis.py``) receives two keyspace notifications for every chunk any engine
puts or the store evicts: in the live mock cluster ~25 per routed request. This bench starts a
redis-server, lets a separate writer process SET the keys of N chunks as LMCache names them, and
measures the CPU the adapter's process spends until its sink holds all N, with redis-py's hiredis
reply parser and with its pure-Python one (each round a fresh process; hiredis hidden from the
other), interleaved.

Prints a human-readable report, then ONE JSON line:
``{"notifications", "us_per_notification_hiredis", "us_per_notification_python", "speedup", "steal_pct"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = "bench-model"


def _steal() -> tuple[float, float]:
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return float(f[7]), sum(float(x) for x in f)


def _write(url: str, n: int) -> None:
    """The writer process: every chunk's two keys, pipelined."""
    import redis

    from smetric_lmc.controller.lmcache_keys import REDIS_SUFFIXES, format_key

    r = redis.Redis.from_url(url)
    pipe = r.pipeline(transaction=False)
    for h in range(1, n + 1):
        for s in REDIS_SUFFIXES:
            pipe.set(format_key(MODEL, 1, 0, h, "bfloat16", suffix=s), b"x")
        if h % 1000 == 0:
            pipe.execute()
    pipe.execute()


def _follow(url: str, n: int, parser: str) -> dict[str, float]:
    """One round in this process: the adapter follows while a writer process writes."""
    if parser == "python":
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # redis-py falls back to its own parser
    import redis.utils

    from smetric_lmc.controller.global_redis import RedisGlobalTier

    class Sink:
        def __init__(self) -> None:
            self.chunks: set[int] = set()

        def global_stored(self, hs: object) -> None:
            self.chunks.update(hs)  # type: ignore[arg-type]

        def global_removed(self, hs: object) -> None:
            self.chunks.difference_update(hs)  # type: ignore[arg-type]

        def global_reset(self, hs: object) -> None:
            self.chunks = set(hs)  # type: ignore[arg-type]

    async def main() -> dict[str, float]:
        sink = Sink()
        tier = RedisGlobalTier(url, sink, model=MODEL, reconcile_interval_s=3600.0)
        task = asyncio.create_task(tier.run())
        while not tier.available:
            await asyncio.sleep(0.02)
        c0, t0 = time.process_time(), time.perf_counter()
        writer = subprocess.Popen([sys.executable, __file__, "--write", url, "--chunks", str(n)])
        while len(sink.chunks) < n:
            await asyncio.sleep(0.005)
        c1, t1 = time.process_time(), time.perf_counter()
        writer.wait()
        await tier.close()
        await task
        return {"us": (c1 - c0) / (2 * n) * 1e6, "wall_s": t1 - t0,
                "hiredis": float(redis.utils.HIREDIS_AVAILABLE)}

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--follow", metavar="URL", help=argparse.SUPPRESS)
    ap.add_argument("--parser", choices=("hiredis", "python"), default="hiredis", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.rounds < 1:
        print("redis_follow: --chunks and --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.write:
        _write(args.write, args.chunks)
        return 0
    if args.follow:
        print(json.dumps(_follow(args.follow, args.chunks, args.parser)))
        return 0

    from smetric_lmc.workers import launch

    try:
        import hiredis  # noqa: F401
    except ImportError:
        print("redis_follow: hiredis is not installed (pip install -e .)", file=sys.stderr)
        return 2
    store = launch.start_global_store("redis")
    url = f"redis://{store.address}/0"
    got: dict[str, list[float]] = {"hiredis": [], "python": []}
    s0, tot0 = _steal()
    try:
        total = args.rounds * 2
        for i in range(args.rounds):
            for parser in ("hiredis", "python"):
                subprocess.run([sys.executable, "-c", "import redis; redis.Redis.from_url("
                                f"{url!r}).flushall()"], check=True)
                out = subprocess.run([sys.executable, __file__, "--follow", url, "--chunks", str(args.chunks),
                                      "--parser", parser], check=True, capture_output=True, text=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if bool(r["hiredis"]) != (parser == "hiredis"):
                    raise RuntimeError(f"the {parser} round ran with hiredis={r['hiredis']}")
                got[parser].append(r["us"])
                done = 2 * i + (1 if parser == "hiredis" else 2)
                print(f"[{done}/{total}] {parser:8s} {r['us']:6.1f} us CPU per notification "
                      f"({2 * args.chunks} in {r['wall_s']:.2f} s)", flush=True)
    finally:
        store.stop()
    s1, tot1 = _steal()
    steal = 100.0 * (s1 - s0) / max(1.0, tot1 - tot0)
    h, p = statistics.median(got["hiredis"]), statistics.median(got["python"])
    print(f"\nthe controller's Redis adapter, {2 * args.chunks} notifications per round, median of "
          f"{args.rounds}: hiredis {h:.1f} us, redis-py's Python parser {p:.1f} us per notification "
          f"({p / h:.2f}x); steal {steal:.1f}%")
    print(json.dumps({"notifications": 2 * args.chunks, "us_per_notification_hiredis": round(h, 2),
                      "us_per_notification_python": round(p, 2), "speedup": round(p / h, 3),
                      "steal_pct": round(steal, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
