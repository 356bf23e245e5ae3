"""Fetch-path profiles: how LMCache retrieves a global-tier hit and puts a new chunk.

A retrieve costs one lookup round trip, a fixed cost per LMCache chunk (256 tokens), and the bytes
moved over the shared links (``transfer.Network``) at no more than the path's per-request throughput
(``request_gbs``, a private resource of the request's fetch). ``staged`` paths move the remote share
to a host buffer first and then everything host -> GPU; unstaged ones cross NIC and PCIe together
(LMCache pipelines chunk batches). A put becomes visible to other instances when it completes.

Profiles live in ``configs/fetch_paths.yaml``; every constant's source is in docs/simulator.md.
Interface: ``load_fetch_path(name) -> FetchPath``, ``fetch_path_names()``,
``FetchPath.unloaded_fetch_s(nbytes, chunks)`` (the time of a lone fetch on idle links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

LMCACHE_CHUNK_TOKENS = 256  # LMCache's default chunk_size: it saves and retrieves whole chunks
DEFAULT_FETCH_PATH = "lmcache-mooncake-rdma"


@dataclass(frozen=True, slots=True)
class FetchPath:
    name: str
    lookup_s: float  # one lookup round trip per retrieve, before any byte moves
    per_chunk_s: float  # fixed cost per chunk retrieved, serial with the transfer
    request_gbs: float  # per-request retrieve throughput cap, GB/s (inf: only the links limit it)
    store_gbs: float  # per-request put throughput cap to the store, GB/s (inf: links only)
    staged: bool  # remote -> host buffer, then host -> GPU, one after the other

    @property
    def request_bps(self) -> float:
        return self.request_gbs * 1e9

    @property
    def store_bps(self) -> float:
        return self.store_gbs * 1e9

    def fixed_s(self, chunks: int) -> float:
        """The latency before the transfer's bytes move: lookup + per-chunk costs."""
        return self.lookup_s + chunks * self.per_chunk_s

    def unloaded_fetch_s(self, nbytes: float, chunks: int, link_bps: float = math.inf) -> float:
        """Time of one fetch alone on idle links of ``link_bps`` (the slowest on its path)."""
        rate = min(self.request_bps, link_bps)
        return self.fixed_s(chunks) + (nbytes / rate if nbytes > 0 else 0.0)

    def with_request_gbs(self, gbs: float) -> FetchPath:
        """The same path with another per-request cap (the regime map's fetch axis)."""
        return replace(self, name=f"{self.name}@{gbs:g}GB/s", request_gbs=gbs)


def _all() -> dict[str, dict[str, Any]]:
    from smetric_lmc.config import packaged_config, read_yaml

    data = read_yaml(packaged_config("fetch_paths.yaml"))
    if not isinstance(data, dict):
        raise ValueError("fetch_paths.yaml: expected a mapping of profile names")
    return data


def fetch_path_names() -> list[str]:
    return sorted(_all())


def load_fetch_path(name: str = DEFAULT_FETCH_PATH) -> FetchPath:
    """A named fetch-path profile; ValueError listing the known names for an unknown one."""
    data = _all()
    if name not in data:
        raise ValueError(f"unknown fetch path {name!r}; known: {', '.join(sorted(data))}")
    raw = dict(data[name])
    known = {f.name for f in fields(FetchPath)} - {"name"}
    bad = sorted(set(raw) ^ known)
    if bad:
        raise ValueError(f"fetch_paths.yaml: {name}: unknown or missing keys {bad}")
    vals: dict[str, Any] = {k: float(raw[k]) for k in known if k != "staged"}
    vals["staged"] = bool(raw["staged"])
    fp = FetchPath(name=name, **vals)
    for k in ("lookup_s", "per_chunk_s"):
        if not getattr(fp, k) >= 0:
            raise ValueError(f"fetch_paths.yaml: {name}: {k} must be >= 0")
    for k in ("request_gbs", "store_gbs"):
        if not getattr(fp, k) > 0:
            raise ValueError(f"fetch_paths.yaml: {name}: {k} must be > 0")
    return fp
