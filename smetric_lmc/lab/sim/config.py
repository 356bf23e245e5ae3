"""Simulator settings (``configs/sim.yaml``): cluster shape, arrivals, global tier, SLO."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from smetric_lmc.config import packaged_config, parse_as, read_yaml
from smetric_lmc.lab.sim.fetch_path import FetchPath, fetch_path_names, load_fetch_path
from smetric_lmc.lab.sim.profile import Profile

GLOBAL_CHOICES = ("none", "0.4", "0.8", "1.6", "full")


class SLO(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    ttft_base_s: float = 2.0  # a in TTFT <= a + b * input_tokens
    ttft_per_token_s: float = 2.0e-4  # b
    tpot_s: float = 0.030

    def ttft_limit(self, input_tokens: Any) -> Any:
        return self.ttft_base_s + self.ttft_per_token_s * input_tokens


class SimConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    profile: str = "qwen3-30b-a3b-h20"
    instances: int = 32
    rate: float = 0.05  # session arrivals per second (Poisson): the offered-load knob
    arrival: Literal["closed", "open"] = "closed"
    global_tier: str = "none"  # none | <multiple of total local capacity> | full (the nodes' host pools)
    # How the engine loads a global-tier hit (DESIGN §4): sync = the whole batch waits (what vLLM's
    # LMCacheConnectorV1 does), layerwise = overlapped with compute layer by layer, async = only the
    # fetching request waits.
    kv_load_mode: Literal["sync", "layerwise", "async"] = "sync"
    # How a global-tier hit is retrieved (configs/fetch_paths.yaml; docs/simulator.md cites each
    # constant): LMCache + Mooncake over RDMA is the paper's testbed. fetch_gbs overrides the
    # profile's per-request retrieve throughput (the regime map's fetch axis).
    fetch_path: str = "lmcache-mooncake-rdma"
    fetch_gbs: float | None = None
    # What load the policy reads (sim/load_signal.py): router = the router's own in-flight counts,
    # exact; scrape = the engines' metrics polled every scrape_s seconds (stale in between).
    load_signal: Literal["router", "scrape"] = "router"
    scrape_s: float = 5.0
    # Policies that read each engine's running batch size as their load instead (sim/load_signal.py,
    # BatchLoadTracker; live, load_signal does not apply to them): `sim paper` lists the paper's
    # Bailian (§4.1: "batch size") and LMetric (its own paper: "current batch size").
    batch_load_policies: tuple[str, ...] = ()
    pd: bool = False  # PD disaggregation: instances only prefill
    pd_decode_tpot_s: float = 0.020  # decode pace assumed on the separate decode pool (PD mode)
    slo: SLO = msgspec.field(default_factory=SLO)
    tps_tokens: Literal["total", "output"] = "total"  # what "tokens" counts in TPS within SLO
    # TPS is measured over the session-arrival period (first to last root-session start: load is
    # sustained there) or over the whole run (first arrival to last completion: ramp-up and drain
    # included, and a long tail session alone sets the end).
    measure: Literal["arrivals", "run"] = "arrivals"
    # False (with measure: arrivals): no request is issued after the last session start; the
    # window's metrics are unchanged (nothing later can touch them) and long sessions need no drain.
    drain: bool = True
    # Share of the session-arrival window left out of the measurement (measure: arrivals): closed-loop
    # sessions pile up until their lifetimes overlap, so the window's first part is a ramp, not the
    # offered load; averaging it in put every peak row below the knee (WEKA's sessions outlive a
    # 10-minute window: its load ramped the whole time).
    warmup_share: float = 0.0
    window_s: float = 60.0  # load-heatmap / imbalance window
    decode_run_max: int = 512  # longest batch of decode iterations advanced in one step
    # Instances slower for a while (sim/slowdown.py): step times x a log-normal factor of this
    # coefficient of variation, drawn afresh per instance every slowdown_period_s. 0: off.
    slowdown_cv: float = 0.0
    slowdown_period_s: float = 30.0
    # Recorded think times above this are clipped: multi-hour gaps are a user away from the keyboard,
    # and replaying them would stretch a run over days of mostly idle cluster time.
    max_think_s: float = 600.0
    max_sessions: int | None = None  # replay only the first N root sessions (with their sub-agents)
    # once: every root session once (the pool can run dry before the GPUs saturate); replace: roots
    # drawn with replacement as a Poisson process over arrival_window_s (offered load = rate at any
    # pool size; copies get distinct ids past the prefix shared with other sessions).
    sampling: Literal["once", "replace"] = "once"
    arrival_window_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ValueError("instances must be >= 1")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        global_capacity_factor(self.global_tier)  # validates
        if self.fetch_path not in fetch_path_names():
            raise ValueError(f"unknown fetch_path {self.fetch_path!r}; known: {', '.join(fetch_path_names())}")
        if not self.scrape_s > 0:
            raise ValueError("scrape_s must be > 0")
        if self.fetch_gbs is not None and not self.fetch_gbs > 0:
            raise ValueError("fetch_gbs must be > 0")
        if self.arrival_window_s <= 0:
            raise ValueError("arrival_window_s must be > 0")
        if not 0 <= self.warmup_share < 1:
            raise ValueError("warmup_share must be within [0, 1)")
        if not (self.slowdown_cv >= 0 and self.slowdown_period_s > 0):
            raise ValueError("slowdown_cv must be >= 0 and slowdown_period_s > 0")

    def fetch(self) -> FetchPath:
        fp = load_fetch_path(self.fetch_path)
        return fp.with_request_gbs(self.fetch_gbs) if self.fetch_gbs is not None else fp

    @property
    def has_global(self) -> bool:
        return self.global_tier != "none"


def global_capacity_factor(choice: str) -> float | None:
    """None (no global tier), a multiple of the total local capacity, or inf (``full``: the nodes'
    configured host pools, see ``global_capacity_blocks``)."""
    if choice == "none":
        return None
    if choice in ("full", "inf"):
        return math.inf
    try:
        f = float(choice)
    except ValueError:
        raise ValueError(f"global_tier must be none, full or a number, got {choice!r}") from None
    if f <= 0:
        raise ValueError("global_tier multiple must be > 0")
    return f


def global_capacity_blocks(choice: str, prof: Profile, block_size: int, instances: int, nodes: int) -> float | None:
    """Global-tier capacity in blocks: None (no tier), multiple x total local capacity, or ``full`` =
    every node's configured host pool (``host_pool_gib_per_node``), LRU like any other."""
    f = global_capacity_factor(choice)
    if f is None:
        return None
    if math.isinf(f):
        return float(nodes * prof.host_pool_blocks_per_node(block_size))
    return f * prof.local_capacity_blocks(block_size) * instances


def load_sim_config(path: str | Path | None = None, **overrides: Any) -> SimConfig:
    """Defaults from the packaged ``configs/sim.yaml`` (or ``path``, which must exist), then keyword
    overrides (None = keep). ConfigError (a ValueError) with the key path on bad input."""
    src = path if path is not None else packaged_config("sim.yaml")
    data = read_yaml(src)
    data.update({k: v for k, v in overrides.items() if v is not None})
    if "global_tier" in data:
        data["global_tier"] = str(data["global_tier"])
    return parse_as(data, SimConfig, str(path or "sim.yaml"))
