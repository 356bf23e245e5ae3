"""Which live objects keep pymalloc arenas resident: a census of reachable objects by arena.

    from arena_census import census; print(census())

pymalloc returns a 1 MiB arena to the OS only when every block in it is free, so after a burst
of short-lived objects a few long-lived ones can pin most of the burst's arenas. This walks every
object reachable from the GC's tracked objects (so also the ints, floats and strings they hold),
reads each small object's pool header (CPython 3.10+ on 64-bit: 16 KiB pools in 1 MiB arenas;
``arenaindex`` at offset 32, ``szidx`` at 36) and reports the arenas holding few live bytes,
with the types and a sample of the objects in them: what to stop allocating during a burst.
Diagnosis only: it reads interpreter memory through ctypes, never writes it.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections import Counter, defaultdict
from typing import Any

import msgspec

POOL_SIZE = 1 << 14
SMALL_REQUEST_THRESHOLD = 512


def _reachable() -> dict[int, Any]:
    seen: dict[int, Any] = {}
    stack = list(gc.get_objects())
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        stack.extend(gc.get_referents(obj))
        if isinstance(obj, msgspec.Struct):  # gc=False Structs have no traverse
            stack.extend(getattr(obj, f, None) for f in obj.__struct_fields__)
    return seen


def _pool_of(addr: int) -> tuple[int, int] | None:
    pool = addr & ~(POOL_SIZE - 1)
    arena = ctypes.c_uint.from_address(pool + 32).value
    szidx = ctypes.c_uint.from_address(pool + 36).value
    return arena, szidx


def census(sparse_mb: float = 0.25, sample: int = 6) -> dict[str, Any]:
    """Arenas by live bytes; for the sparse ones (< ``sparse_mb`` live), what lives there."""
    gc.collect()
    gc.unfreeze()  # frozen objects are not in gc.get_objects()
    objs = _reachable()
    by_arena: dict[int, list[Any]] = defaultdict(list)
    bytes_by_arena: Counter[int] = Counter()
    skipped = 0
    for addr, obj in objs.items():
        try:
            size = sys.getsizeof(obj)
        except TypeError:
            skipped += 1
            continue
        if size > SMALL_REQUEST_THRESHOLD:
            continue
        arena, szidx = _pool_of(addr)
        block = (szidx + 1) * 16
        if not (size <= block < size + 16 + 16 * 2) or arena > 1 << 20:  # not a pymalloc block
            skipped += 1
            continue
        by_arena[arena].append(obj)
        bytes_by_arena[arena] += block
    ignore = {id(objs), id(by_arena), id(bytes_by_arena)} | {id(v) for v in by_arena.values()}
    sparse = sorted((a for a, b in bytes_by_arena.items() if b < sparse_mb * 2**20), key=bytes_by_arena.__getitem__)
    report = []
    for a in sparse:
        kinds = Counter(type(o).__name__ for o in by_arena[a])
        report.append({
            "arena": a, "live_kb": round(bytes_by_arena[a] / 1024, 1), "objects": len(by_arena[a]),
            "types": dict(kinds.most_common(6)),
            "sample": _sample(by_arena[a], sample, ignore),
        })
    return {
        "objects": len(objs), "arenas_seen": len(bytes_by_arena), "sparse_arenas": len(sparse),
        "sparse_live_kb": round(sum(bytes_by_arena[a] for a in sparse) / 1024, 1),
        "not_pymalloc_or_unsized": skipped, "sparse": report,
    }


def _sample(objs: list[Any], n: int, ignore: set[int]) -> list[str]:
    out: list[str] = []
    for i in range(min(n, len(objs))):
        out.append(_describe(objs[i], ignore | {id(out)}))
    return out


def _describe(obj: Any, ignore: set[int], depth: int = 3) -> str:
    """The object and a chain of its owners: containers by type, dict entries by key, objects by class."""
    text = repr(obj) if isinstance(obj, (int, float, str, bytes)) else type(obj).__name__
    chain = [text[:50]]
    for _ in range(depth):
        owners = [r for r in gc.get_referrers(obj) if id(r) not in ignore and not _is_frame(r)]
        if not owners:
            break
        owner = owners[0]
        if isinstance(owner, dict):
            keys = [k for k, v in owner.items() if v is obj][:1]
            chain.append(f"dict[{keys[0]!r:.40}]" if keys else "dict(key)")
            holders = [r for r in gc.get_referrers(owner) if id(r) not in ignore and not _is_frame(r)]
            if holders and not isinstance(holders[0], (dict, list)):
                chain.append(type(holders[0]).__qualname__)
                break
        elif isinstance(owner, (list, tuple, set, frozenset)):
            chain.append(f"{type(owner).__name__}[{len(owner)}]")
        else:
            attrs = [k for k, v in getattr(owner, "__dict__", {}).items() if v is obj][:1]
            chain.append(type(owner).__qualname__ + (f".{attrs[0]}" if attrs else ""))
        ignore = ignore | {id(obj)}
        obj = owner
    return " <- ".join(chain)


def _is_frame(obj: Any) -> bool:
    return type(obj).__name__ in ("frame", "cell")
