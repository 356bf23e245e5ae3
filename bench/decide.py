"""In-process route decision cost (DESIGN.md §5).

64 instances, 1 M indexed GPU blocks (16-token blocks), a 32k-token prompt given as hashes.
Every instance holds a shared 2k-token system prompt plus its own sessions; queries are follow-ups
of stored sessions (a long hit on one instance) and new sessions (only the shared prefix hits).
The timed unit is ``Router.route``: lookup + policy + load accounting, exactly what the controller
runs per request. Each query's hashes are msgpack-decoded just before its timed call, as the
controller receives them off the wire (so they are fresh objects, not ones cached since setup). Also: token ids -> fast-chain hashes for 32k tokens, and bytes per indexed block.

Prints human-readable figures, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import time

import msgspec

from smetric_lmc.config import PolicyConfig
from smetric_lmc.hashing import fast_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

BS = 16
CS = 256
PROMPT = 32 * 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def populate(ix: TierIndex, n_instances: int, n_blocks: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    """Fill the index; returns (instance, chain) of every stored session."""
    shared = [rng.getrandbits(64) for _ in range(2048 // BS)]
    sessions: list[tuple[str, list[int]]] = []
    per_instance = n_blocks // n_instances
    for k in range(n_instances):
        inst = f"inst{k:02d}"
        ix.gpu_stored_hashes(inst, shared)
        held = len(shared)
        while held < per_instance:
            length = min(rng.randint(64, PROMPT // BS - len(shared)), per_instance - held)
            own = [rng.getrandbits(64) for _ in range(length)]
            ix.gpu_stored_hashes(inst, own, shared[-1])
            # the LMCache CPU tier holds the same sessions at 256-token chunks
            ix.lmcache_admit(inst, own[:: CS // BS])
            sessions.append((inst, shared + own))
            held += length
    return sessions


def time_us(fn, queries) -> list[float]:
    dec = msgspec.msgpack.Decoder(list[int])
    out = []
    for rid, blocks, chunks, turn, est in queries:
        q = (rid, dec.decode(blocks), dec.decode(chunks), turn, est)
        t0 = time.perf_counter_ns()
        fn(q)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    ix = TierIndex(BS, CS)
    for k in range(args.instances):
        ix.register_instance(f"inst{k:02d}")
    gc.collect()
    before = rss_mb()
    t0 = time.perf_counter()
    sessions = populate(ix, args.instances, args.blocks, rng)
    fill_s = time.perf_counter() - t0
    gc.collect()
    per_block = (rss_mb() - before) * 2**20 / max(1, ix.sizes()["gpu_nodes"])
    print(f"index: {ix.sizes()} filled in {fill_s:.1f} s, ~{per_block:.0f} bytes per indexed block (RSS delta, "
          "including the LMCache tier entries)")

    router = Router(ix, LoadTracker(), PolicyConfig(name="smetric"))
    n_blocks = PROMPT // BS
    queries = []
    for q in range(args.queries):
        if q % 4 == 3:  # a new session: only the shared system prompt hits
            chain = sessions[0][1][: 2048 // BS] + [rng.getrandbits(64) for _ in range(n_blocks - 2048 // BS)]
            turn = 0
        else:  # a follow-up of a stored session, grown to 32k tokens
            inst, chain = rng.choice(sessions)
            chain = chain + [rng.getrandbits(64) for _ in range(n_blocks - len(chain))]
            turn = 3
        queries.append((f"q{q}", msgspec.msgpack.encode(chain), msgspec.msgpack.encode(chain[:: CS // BS]), turn,
                        (len(chain) - 8) * BS))

    def gpu_only(q):
        rid, chain, _chunks, turn, est = q
        router.route(rid, chain, None, PROMPT, turn=turn, est_hit=est)
        router.load.on_done(rid)

    def all_tiers(q):
        rid, chain, chunks, turn, est = q
        router.route(rid, chain, chunks, PROMPT, turn=turn, est_hit=est)
        router.load.on_done(rid)

    gc.disable()
    time_us(gpu_only, queries[:200])  # warm up
    t_gpu = time_us(gpu_only, queries)
    t_all = time_us(all_tiers, queries)
    tokens = [rng.randrange(150_000) for _ in range(PROMPT)]
    t_hash = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        fast_chain(tokens, BS)
        t_hash.append((time.perf_counter_ns() - t0) / 1e6)
    gc.enable()

    print(f"route decision, GPU tier (2048 blocks/prompt): p50 {pct(t_gpu, 50):.1f} us, p99 {pct(t_gpu, 99):.1f} us")
    print(f"route decision, GPU + LMCache + global tiers:  p50 {pct(t_all, 50):.1f} us, p99 {pct(t_all, 99):.1f} us")
    print(f"token ids -> fast hashes, 32k tokens: median {statistics.median(t_hash):.3f} ms")
    print("targets: decide p50 <= 30 us, p99 <= 100 us; hashing <= 1 ms")
    print(json.dumps({
        "decide_p50_us": round(pct(t_all, 50), 2),
        "decide_p99_us": round(pct(t_all, 99), 2),
        "decide_gpu_only_p50_us": round(pct(t_gpu, 50), 2),
        "decide_gpu_only_p99_us": round(pct(t_gpu, 99), 2),
        "hash_32k_ms": round(statistics.median(t_hash), 4),
        "bytes_per_block": round(per_block),
    }))


if __name__ == "__main__":
    main()
