"""Typed configuration (``configs/smetric.yaml``).

Every field has the default DESIGN.md gives; unknown keys are errors, and a bad file fails with
the key path and the reason (``ConfigError``), never a traceback from deep inside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

PolicyName = Literal[
    "smetric", "load_balance", "bailian", "lmetric", "dynamo", "round_robin", "cache_first", "smetric_cost"
]
POLICY_NAMES: tuple[str, ...] = PolicyName.__args__  # type: ignore[attr-defined]


class _Cfg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class PolicyConfig(_Cfg):
    name: PolicyName = "smetric"
    overload: float = 2.0  # SMetric OVERLOAD; use .inf to never shed
    hit_ratio: float = 0.5  # SMetric HIT_RATIO
    bailian_lambda: float = 0.9  # weight of the miss term in the bailian linear score
    lmetric_load_offset: float = 1.0  # (L - c) * (l + offset): idle instances do not all tie at 0
    # smetric_cost (our variant; hit_ratio above labels its moves): share of a computed token's cost
    # that fetching it from the global tier saves
    cost_fetch_discount: float = 0.9

    def __post_init__(self) -> None:
        if self.overload < 0:
            raise ValueError("overload must be >= 0")
        if not 0 <= self.hit_ratio <= 1:
            raise ValueError("hit_ratio must be within [0, 1]")
        if not 0 <= self.bailian_lambda <= 1:
            raise ValueError("bailian_lambda must be within [0, 1]")
        if not 0 <= self.cost_fetch_discount <= 1:
            raise ValueError("cost_fetch_discount must be within [0, 1]")


class InstanceConfig(_Cfg):
    id: str
    http: str  # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000
    kv_events: str | None = None  # vLLM KV events endpoint to subscribe to
    kv_events_bind: bool = False  # vLLM connects (endpoint without '*'): the controller binds instead
    replay: str | None = None  # vLLM KV events replay endpoint
    kv_events_topic: str = "kv"  # must match the topic in vLLM's --kv-events-config
    lmcache_instance_id: str | None = None
    role: Literal["both", "prefill", "decode"] = "both"
    node: str = "node0"  # instances on one node share its link to the global tier


class HashingConfig(_Cfg):
    block_size: int = 16  # vLLM block size of every instance (the GPU tier's granularity)
    vllm_hash_algo: Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"] = "sha256_cbor"
    fast_namespace: str = ""  # seeds the controller's own chain (e.g. the model name)
    lmcache_chunk_size: int = 256
    lmcache_hash: Literal["builtin", "sha256_cbor"] = "builtin"
    # NONE_HASH the LMCache chain starts from: an int, or how LMCache derives it — "zero" (LMCache
    # without vLLM), "vllm_builtin" / "vllm_sha256_cbor" (with vLLM; these depend on the workers'
    # PYTHONHASHSEED, given as lmcache_root_seed).
    lmcache_root: int | Literal["zero", "vllm_builtin", "vllm_sha256_cbor"] = 0
    lmcache_root_seed: str | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.lmcache_chunk_size <= 0:
            raise ValueError("block sizes must be positive")

    def lmcache_root_value(self) -> int:
        if isinstance(self.lmcache_root, int):
            return self.lmcache_root
        from smetric_lmc.hashing import lmcache_root

        return lmcache_root(self.lmcache_root, seed=self.lmcache_root_seed)


class GlobalStoreConfig(_Cfg):
    kind: Literal["none", "mooncake", "redis"] = "none"
    url: str | None = None  # redis://127.0.0.1:6379/0
    events_endpoint: str | None = None  # Mooncake master KV events (ZMQ PUB)
    master_http: str | None = None  # Mooncake master HTTP (GET /get_all_keys)
    model: str = ""  # LMCache key model name
    world_size: int = 1
    reconcile_interval_s: float = 30.0


class LMCacheConfig(_Cfg):
    enabled: bool = False
    pull_url: str = "tcp://127.0.0.1:8300"
    reply_url: str = "tcp://127.0.0.1:8400"
    heartbeat_url: str | None = None
    upstream_pull_url: str | None = None  # forward to a real LMCache controller
    upstream_reply_url: str | None = None


class ServerConfig(_Cfg):
    route_url: str = "tcp://127.0.0.1:5600"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9600
    curve_secret_key: str | None = None  # Z85; enables ZMQ CURVE on the route socket
    curve_public_key: str | None = None


class LoadConfig(_Cfg):
    metrics_poll_s: float = 2.0  # engine /metrics reconciliation period (0 disables)
    metrics_timeout_s: float = 10.0  # a busy CPU engine's API server can take seconds to answer
    lost_done_grace_s: float = 30.0  # in-flight entries older than this may be healed by engine metrics
    instance_timeout_s: float = 30.0  # silent instance leaves routing after this


class Config(_Cfg):
    model: str = ""
    pd_mode: Literal["colocated", "disaggregated"] = "colocated"
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    hashing: HashingConfig = msgspec.field(default_factory=HashingConfig)
    instances: list[InstanceConfig] = []
    global_store: GlobalStoreConfig = msgspec.field(default_factory=GlobalStoreConfig)
    lmcache: LMCacheConfig = msgspec.field(default_factory=LMCacheConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    load: LoadConfig = msgspec.field(default_factory=LoadConfig)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for inst in self.instances:
            if inst.id in seen:
                raise ValueError(f"duplicate instance id {inst.id!r}")
            seen.add(inst.id)


class ConfigError(ValueError):
    """A configuration problem, with the key path it concerns."""


def _humanize(exc: msgspec.ValidationError, source: str) -> ConfigError:
    # msgspec says "Expected `int`, got `str` - at `$.policy.overload`": lead with the key path.
    text = str(exc)
    reason, _, where = text.partition(" - at `")
    path = where.rstrip("`").removeprefix("$").lstrip(".") or "<top level>"
    return ConfigError(f"{source}: {path}: {reason}")


def parse_config(data: Any, source: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: <top level>: expected a mapping, got {type(data).__name__}")
    try:
        return msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        raise _humanize(exc, source) from None


def load_config(path: str | Path) -> Config:
    """Load and validate a YAML config; raises ConfigError with the key path and reason."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{p}: {where}invalid YAML: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, str(p))
