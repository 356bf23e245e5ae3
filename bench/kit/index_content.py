"""Comparing two indexes' content: the restart and snapshot tests and ``bench/faults.py`` check a
restored or replayed index against the truth with it (test code, not package code)."""

from __future__ import annotations

from typing import Any

from smetric_lmc.index import TierIndex


def same_content(a: TierIndex, b: TierIndex, instances: list[str] | None = None) -> list[str]:
    """Differences between two indexes' content (GPU rows with parents, engine hashes and stale
    flags, LMCache chunks, global chunks); empty when equal."""
    diffs = []
    for iid in instances if instances is not None else sorted(set(a.instances) | set(b.instances)):
        x, y = a.export_instance(iid), b.export_instance(iid)
        for part in ("gpu", "chunks"):
            sx, sy = _as_set(x, part), _as_set(y, part)
            if sx != sy:
                diffs.append(f"{iid} {part}: {len(sx - sy)} only in the first, {len(sy - sx)} only in the second")
    if set(a.export_global().tolist()) != set(b.export_global().tolist()):
        diffs.append("global chunks differ")
    return diffs


def _as_set(st: dict[str, Any], part: str) -> set[Any]:
    if part == "chunks":
        return set(st["chunks"].tolist())
    return set(zip(st["hash"].tolist(), st["parent"].tolist(), st["eng"].tolist(), st["stale"].tolist()))
