"""A route core over registered instances, for the route-service tests and bench/soak.py."""

from __future__ import annotations

from smetric_lmc.config import InstanceConfig, PolicyConfig
from smetric_lmc.controller.service import RouteCore
from smetric_lmc.hashing import HashSettings, fast_root
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router

BS = 16

ROOT = fast_root("test-model")

def make_core(
    n: int = 2, *, want_chunks: bool = False, disaggregated: bool = False, roles: list[str] | None = None
) -> RouteCore:
    index = TierIndex(BS, 256, fast_root=ROOT)
    load = LoadTracker()
    insts = [
        InstanceConfig(id=f"i{k}", http=f"http://127.0.0.1:{8000 + k}", role=(roles[k] if roles else "both"))  # type: ignore[arg-type]
        for k in range(n)
    ]
    for inst in insts:
        index.register_instance(inst.id)
        load.add_instance(inst.id)
    router = Router(index, load, PolicyConfig(), disaggregated=disaggregated)
    hs = HashSettings(block_size=BS, fast_root=ROOT, want_chunks=want_chunks)
    return RouteCore(index, load, router, insts, hs, disaggregated=disaggregated)
