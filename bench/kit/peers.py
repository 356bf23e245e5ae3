"""The peer indexers' harness: the same cluster built in our TierIndex, NVIDIA Dynamo's RadixTree
and LMCache 0.5.6's controller, the same queries, and the agreement of their best hits.

``bench/peers.py`` prints the comparison; ``tests/test_peers.py`` checks the agreement at a reduced
size. What each peer does and how memory and latency are taken: ``bench/peers.py``'s docstring.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import random
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent.parent
BS = 16
CHUNK_BLOCKS = 16  # LMCache's 256-token chunks
PROMPT_BLOCKS = 2048
SHARED_BLOCKS = 128


@dataclass(frozen=True)
class Size:
    instances: int
    blocks: int
    queries: int
    seed: int = 7


@dataclass
class Result:
    peer: str
    build_s: float = 0.0
    blocks: int = 0
    bytes_per_block: float | None = None
    lookup_us: list[float] = field(default_factory=list)
    best: list[int] = field(default_factory=list)  # per query: longest prefix held anywhere (blocks)

    def pct(self, p: float) -> float:
        xs = sorted(self.lookup_us)
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


# ---- the cluster, generated identically in every process ---------------------------------------
class Cluster:
    """Per block three independent 64-bit hashes: ours (chained), the engine's, and the tokens
    hash Dynamo matches on. Sessions are slices of one array each, so 10 M blocks stay compact."""

    def __init__(self, size: Size) -> None:
        rng = np.random.default_rng(size.seed)
        py = random.Random(size.seed)
        self.n = size.instances
        per_instance = size.blocks // size.instances
        self.owner: list[int] = []
        self.bounds: list[tuple[int, int]] = []
        total = 0
        for k in range(size.instances):
            held = SHARED_BLOCKS
            while held < per_instance:
                length = min(py.randint(64, PROMPT_BLOCKS - SHARED_BLOCKS), per_instance - held)
                self.owner.append(k)
                self.bounds.append((total, total + length))
                total += length
                held += length
        hi = np.iinfo(np.uint64).max
        self.ours, self.eng, self.tok = (rng.integers(1, hi, total, dtype=np.uint64, endpoint=True) for _ in range(3))
        self.shared = [rng.integers(1, hi, SHARED_BLOCKS, dtype=np.uint64, endpoint=True) for _ in range(3)]
        self.blocks = SHARED_BLOCKS + total
        self.queries: list[tuple[int, int]] = []  # (session or -1 for a new one, fresh tail seed)
        for q in range(size.queries):
            self.queries.append((-1 if q % 4 == 3 else py.randrange(len(self.bounds)), py.getrandbits(32)))

    def query(self, q: int, which: int) -> list[int]:
        """Query ``q``'s block hashes in space ``which`` (0 ours, 1 engine, 2 tokens)."""
        s, seed = self.queries[q]
        parts = [self.shared[which]]
        if s >= 0:
            a, b = self.bounds[s]
            parts.append((self.ours, self.eng, self.tok)[which][a:b])
        have = sum(len(p) for p in parts)
        tail = np.random.default_rng(seed).integers(1, 2**63, PROMPT_BLOCKS - have, dtype=np.uint64)
        return np.concatenate([*parts, tail + np.uint64(which)]).tolist()

    def expected_best(self, q: int) -> int:
        s, _ = self.queries[q]
        return SHARED_BLOCKS + (self.bounds[s][1] - self.bounds[s][0] if s >= 0 else 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def timed(fn: Callable[[list[int]], int], queries: list[list[int]], res: Result) -> None:
    gc.disable()
    try:
        for chain in queries[: min(200, len(queries))]:  # warm up
            fn(chain)
        for chain in queries:
            t0 = time.perf_counter_ns()
            best = fn(chain)
            res.lookup_us.append((time.perf_counter_ns() - t0) / 1000)
            res.best.append(best)
    finally:
        gc.enable()


# ---- peers --------------------------------------------------------------------------------------
def run_ours(size: Size) -> Result:
    from smetric_lmc.index import TierIndex

    c = Cluster(size)
    res = Result("ours", blocks=c.blocks)
    queries = [c.query(q, 0) for q in range(len(c.queries))]
    ix = TierIndex(BS, CHUNK_BLOCKS * BS)
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    shared, shared_eng = c.shared[0].tolist(), c.shared[1].tolist()
    for k in range(c.n):
        ix.register_instance(f"w{k}")
        ix.gpu_stored_hashes(f"w{k}", shared, engine_hashes=shared_eng)
    for k, (a, b) in zip(c.owner, c.bounds):
        ix.gpu_stored_hashes(f"w{k}", c.ours[a:b].tolist(), shared[-1], engine_hashes=c.eng[a:b].tolist())
    res.build_s = time.perf_counter() - t0
    gc.collect()
    res.bytes_per_block = (rss_bytes() - before) / c.blocks
    assert ix.sizes()["gpu_nodes"] == c.blocks
    timed(lambda chain: max(ix.lookup(chain).gpu_blocks), queries, res)
    return res


def run_dynamo(size: Size) -> Result:
    import msgspec
    from dynamo._core import RadixTree  # the `peers` extra: pip install ai-dynamo-runtime

    c = Cluster(size)
    res = Result("dynamo", blocks=c.blocks)
    queries = [c.query(q, 2) for q in range(len(c.queries))]
    enc = msgspec.json.Encoder()
    tree = RadixTree()
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    event_id = 0

    def store(worker: int, parent: int | None, eng: np.ndarray, tok: np.ndarray) -> None:
        nonlocal event_id
        event_id += 1
        blocks = [{"block_hash": e, "tokens_hash": t} for e, t in zip(eng.tolist(), tok.tolist())]
        tree.apply_event(worker, enc.encode({"event_id": event_id,
                                             "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}))

    for k in range(c.n):
        store(k, None, c.shared[1], c.shared[2])
    last_shared = int(c.shared[1][-1])
    for k, (a, b) in zip(c.owner, c.bounds):
        store(k, last_shared, c.eng[a:b], c.tok[a:b])
    res.build_s = time.perf_counter() - t0
    gc.collect()
    res.bytes_per_block = (rss_bytes() - before) / c.blocks
    timed(lambda chain: max(tree.find_matches(chain).scores.values(), default=0), queries, res)
    return res


def _lmcache_spec(c: Cluster) -> dict[str, Any]:
    """The sessions at 256-token chunks (a chunk's hash: that of its last block)."""
    shared = c.shared[0][CHUNK_BLOCKS - 1 :: CHUNK_BLOCKS].tolist()
    admits = [{"instance": f"w{k}", "hashes": shared} for k in range(c.n)]
    admits += [{"instance": f"w{k}", "hashes": c.ours[a + CHUNK_BLOCKS - 1 : b : CHUNK_BLOCKS].tolist()}
               for k, (a, b) in zip(c.owner, c.bounds)]
    lookups = [c.query(q, 0)[CHUNK_BLOCKS - 1 :: CHUNK_BLOCKS] for q in range(len(c.queries))]
    return {"chunk_size": CHUNK_BLOCKS * BS, "admits": admits, "lookups": lookups}


# Runs inside the LMCache venv: LMCache's own registry and lookup, driven by the helpers of
# kit/lmcache_reference.py (its module docstring says exactly what is timed); the bench folder is
# given as the child's PYTHONPATH.
_LMCACHE_WORKER = r"""
import gc, json, resource, sys, time
from kit import lmcache_reference as R
spec = json.load(open(sys.argv[1]))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
gc.collect(); before = rss(); t0 = time.perf_counter()
reg = R.build(spec["admits"])
build_s = time.perf_counter() - t0
gc.collect(); mem = rss() - before
kv = R.KVController(registry=reg)
given = R._GivenHashes(spec["chunk_size"])
kv.token_database = given
lat, best = [], []
for i, hashes in enumerate(spec["lookups"]):
    given.hashes = hashes
    msg = R.LookupMsg(event_id=f"l{i}", tokens=[])
    ret, samples = R._time(lambda m=msg: R._run(kv.lookup(m)), 3)
    lat.append(min(samples))
    best.append(max((v[-1] for v in ret.layout_info.values()), default=0) // spec["chunk_size"])
print(json.dumps({"build_s": build_s, "mem": mem, "chunks": reg.get_total_kv_count(), "lat": lat, "best": best}))
"""


def run_lmcache(size: Size) -> tuple[Result, Result] | None:
    """(LMCache, our LMCache tier) on the same chunks, or None without the LMCache venv."""
    from kit.lmcache_venv import lmcache_python
    py = lmcache_python()
    if py is None:
        return None
    from smetric_lmc.index import TierIndex

    c = Cluster(size)
    spec = _lmcache_spec(c)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        out = subprocess.run([str(py), "-c", _LMCACHE_WORKER, f.name], capture_output=True, text=True,
                             timeout=3600, check=False, env={**os.environ, "PYTHONPATH": str(BENCH)})
    finally:
        Path(f.name).unlink()
    if out.returncode != 0:
        raise RuntimeError(f"LMCache worker failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout)
    theirs = Result("lmcache", build_s=got["build_s"], blocks=got["chunks"], bytes_per_block=got["mem"] / got["chunks"],
                    lookup_us=got["lat"], best=got["best"])
    ix = TierIndex(BS, CHUNK_BLOCKS * BS)
    for k in range(c.n):
        ix.register_instance(f"w{k}")
    t0 = time.perf_counter()
    for a in spec["admits"]:
        ix.lmcache_admit(a["instance"], a["hashes"])
    ours = Result("ours-lmcache-tier", build_s=time.perf_counter() - t0, blocks=got["chunks"])
    timed(lambda chunks: max(ix.lookup([], chunks).lmcache_chunks), spec["lookups"], ours)
    return theirs, ours


# ---- driver -------------------------------------------------------------------------------------
def _child(fn_name: str, size: Size, conn: Any) -> None:
    try:
        conn.send(("ok", globals()[fn_name](size)))
    except BaseException as exc:  # report to the parent rather than die silently
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def isolated(fn_name: str, size: Size) -> Any:
    """Run ``fn_name(size)`` in a fresh process, so its RSS delta is its index alone."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(fn_name, size, child))
    proc.start()
    status, value = parent.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{fn_name}: {value}")
    return value


def agreement(a: Result, b: Result) -> float:
    return sum(x == y for x, y in zip(a.best, b.best, strict=True)) / max(1, len(a.best))


def compare(size: Size, peers: list[str], run: Callable[[str, Size], Any] = isolated) -> dict[str, Any]:
    """Every peer on one size: their results, and each one's agreement with ours."""
    ours = run("run_ours", size)
    expected = Cluster(size)
    want = [expected.expected_best(q) for q in range(len(expected.queries))]
    out: dict[str, Any] = {"ours": ours, "agree": {"generator": sum(x == y for x, y in zip(ours.best, want)) / len(want)}}
    if "dynamo" in peers:
        dyn = run("run_dynamo", size)
        out["dynamo"] = dyn
        out["agree"]["dynamo"] = agreement(ours, dyn)
    if "lmcache" in peers:
        pair = run("run_lmcache", size)
        if pair is not None:
            out["lmcache"], out["ours_lmcache"] = pair
            out["agree"]["lmcache"] = agreement(pair[1], pair[0])
            want_chunks = [w // CHUNK_BLOCKS for w in want]
            out["agree"]["lmcache_generator"] = sum(x == y for x, y in zip(pair[1].best, want_chunks)) / len(want)
    return out
