"""Typed configuration (``configs/smetric.yaml``) and the one YAML loader every config file uses.

Every field has the default DESIGN.md gives; unknown keys are errors, and a bad file fails with
the key path and the reason (``ConfigError``), never a traceback from deep inside. The controller
config, the simulator config and the hardware profiles are all read through :func:`read_yaml` /
:func:`load_yaml`; the files under ``configs/`` ship with the package (:func:`packaged_config`).
"""

from __future__ import annotations

import logging
import warnings
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable

from smetric_lmc.policy import POLICY_NAMES as POLICY_NAMES  # re-exported: the CLI and simulator read it here
from smetric_lmc.policy import make_policy, policy_names

log = logging.getLogger(__name__)


class _Cfg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class PolicyConfig(_Cfg):
    name: str = "smetric"  # one of POLICY_NAMES (every policy registered in smetric_lmc.policy)
    overload: float = 2.0  # SMetric OVERLOAD; use .inf to never shed
    hit_ratio: float = 0.5  # SMetric HIT_RATIO
    bailian_lambda: float = 0.9  # weight of the miss term in the bailian linear score
    lmetric_load_offset: float = 1.0  # (L - c) * (l + offset): idle instances do not all tie at 0
    # The experimental policy's parameters (smetric_ect: ECTParams in smetric_lmc/policy/smetric_ect.py
    # documents each); empty: its defaults (cold-start prices, SLO-derived slack)
    params: dict[str, float] = {}
    # Deprecated spellings (moved under `params`; accepted with a warning): ect_* -> params.*
    cost_fetch_discount: float | None = None  # smetric_cost was removed: ignored
    ect_prefill_us: float | None = None
    ect_prefill_us_per_ktok: float | None = None
    ect_fetch_us: float | None = None
    ect_inflight_us: float | None = None
    ect_displace: float | None = None
    ect_slack_s: float | None = None
    ect_slack_s_per_tok: float | None = None
    ect_drag_no_global: float | None = None
    ect_queue_no_global: float | None = None

    def __post_init__(self) -> None:
        names = policy_names()  # every registered policy, including ones registered after import
        if self.name not in names:
            raise ValueError(f"name: unknown policy {self.name!r}; expected one of {', '.join(names)}")
        if self.overload < 0:
            raise ValueError("overload must be >= 0")
        if not 0 <= self.hit_ratio <= 1:
            raise ValueError("hit_ratio must be within [0, 1]")
        if not 0 <= self.bailian_lambda <= 1:
            raise ValueError("bailian_lambda must be within [0, 1]")
        if self.params and not self.name.startswith("smetric_ect"):
            raise ValueError(f"params: policy {self.name!r} takes none (only smetric_ect does)")
        self._move_deprecated()
        make_policy(self)  # checks the params (unknown keys, negative values)

    def _move_deprecated(self) -> None:
        """Old top-level ``ect_*`` keys -> ``params`` (an explicit ``params`` entry wins)."""
        moved: dict[str, float] = {}
        for old, new in _ECT_RENAMED.items():
            v = getattr(self, old)
            if v is None:
                continue
            setattr(self, old, None)
            if not v >= 0:
                raise ValueError(f"{old} must be >= 0")
            # the old slack was half the TTFT SLO outright; the new one is slack_share (1/2) x the SLO
            moved[new] = 2.0 * v if new.startswith("slo_") else v
            _warn_deprecated(f"policy.{old}", f"policy.params.{new}")
        if self.cost_fetch_discount is not None:
            self.cost_fetch_discount = None
            _warn_deprecated("policy.cost_fetch_discount", None)
        if moved:
            self.params = {**moved, **self.params}


_ECT_RENAMED = {
    "ect_prefill_us": "prefill_us", "ect_prefill_us_per_ktok": "prefill_us_per_ktok", "ect_fetch_us": "fetch_us",
    "ect_inflight_us": "inflight_us", "ect_displace": "displace", "ect_slack_s": "slo_ttft_s",
    "ect_slack_s_per_tok": "slo_ttft_s_per_tok", "ect_drag_no_global": "drag_no_global",
    "ect_queue_no_global": "queue_no_global",
}  # fmt: skip


def _warn_deprecated(old: str, new: str | None) -> None:
    what = f"use {new}" if new else "it has no effect (smetric_cost was removed)"
    msg = f"{old} is deprecated: {what}"
    warnings.warn(msg, DeprecationWarning, stacklevel=4)
    logging.getLogger(__name__).warning("config: %s", msg)

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


class GlobalStoreConfig(_Cfg):
    kind: Literal["none", "mooncake", "redis"] = "none"
    url: str | None = None  # redis://127.0.0.1:6379/0
    events_endpoint: str | None = None  # Mooncake master KV events (ZMQ PUB)
    master_http: str | None = None  # Mooncake master HTTP (GET /get_all_keys)
    # With both: a store client (no memory of its own) answers batch_is_exist on the keys we know,
    # for masters that expose no key listing. Needs the mooncake extra.
    master_addr: str | None = None  # Mooncake master RPC, host:port
    metadata_server: str | None = None  # e.g. http://127.0.0.1:8080/metadata or P2PHANDSHAKE
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
    curve_client_keys: list[str] = []  # Z85 public keys allowed in; ["*"] = any key (encryption only)

    def __post_init__(self) -> None:
        if self.curve_secret_key or self.curve_public_key:
            from smetric_lmc.curve import check_client_keys, check_keypair

            check_keypair(self.curve_secret_key, self.curve_public_key)
            if not self.curve_client_keys:
                raise ValueError(
                    "CURVE on: list the clients' public keys in curve_client_keys "
                    "(or [\"*\"] to accept any key: encryption without authentication)"
                )
            check_client_keys(self.curve_client_keys)


class LoadConfig(_Cfg):
    metrics_poll_s: float = 2.0  # engine /metrics reconciliation period (0 disables)
    metrics_timeout_s: float = 10.0  # a busy CPU engine's API server can take seconds to answer
    lost_done_grace_s: float = 30.0  # in-flight entries older than this may be healed by engine metrics
    instance_timeout_s: float = 30.0  # silent instance leaves routing after this
    breaker_probe_s: float = 0.25  # first re-probe of an instance taken out (doubles up to metrics_poll_s)

    def __post_init__(self) -> None:
        if self.breaker_probe_s <= 0:
            raise ValueError("breaker_probe_s must be > 0")


class SnapshotConfig(_Cfg):
    path: str | None = None  # index snapshot file; None: no snapshots (off)
    interval_s: float = 10.0  # how often it is rewritten (and once more at a clean stop)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError("interval_s must be > 0")


class ReplicasConfig(_Cfg):
    """Controller replicas sharing in-flight load (see controller/replicas.py)."""

    id: str = ""  # this replica's name, unique among its peers ("" = host:pid)
    pub_url: str = ""  # where this replica publishes its routed/done/prefilled counts ("" = no sharing)
    peers: list[str] = []  # the other replicas' pub_url


class LimitsConfig(_Cfg):
    """Bounds on what a peer may send; anything above is refused with a reason and counted."""

    max_frame_bytes: int = 16 << 20  # route socket and its decoder; every larger frame gets too_large
    # The transport's hard cap on one route frame: up to it a frame is answered too_large; beyond it
    # ZMQ drops the sender's connection mid-frame (no reply possible) so no peer can make the
    # controller hold an unbounded message. Counted as route_socket.cut_connections.
    max_transport_bytes: int = 256 << 20
    max_prompt_tokens: int = 1 << 22  # token_ids length, prompt_tokens, est_hit_tokens
    max_turn: int = 1_000_000
    kv_max_frame_bytes: int = 64 << 20  # one vLLM KV-event message
    kv_max_events_per_batch: int = 65_536
    kv_max_blocks_per_event: int = 65_536  # a 1M-token prompt at block size 16
    replay_frame_timeout_s: float = 1.0  # silence between two replayed batches
    replay_deadline_s: float = 10.0  # whole replay, however fast the peer trickles
    lmcache_max_frame_bytes: int = 16 << 20
    lmcache_max_workers: int = 4096  # (lmcache instance, worker) pairs known at once
    lmcache_max_sources_per_instance: int = 256  # (worker, location) sources feeding one instance
    lmcache_worker_timeout_s: float = 300.0  # silent unmapped or heartbeating workers are forgotten
    lmcache_max_sync_batches: int = 100_000  # full-sync batch_count (LMCache sends 2,000 keys each)

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_transport_bytes < self.max_frame_bytes:
            raise ValueError("max_transport_bytes must be >= max_frame_bytes")


class PeerApisConfig(_Cfg):
    """Read-only index queries other stacks already make (controller/peer_apis.py); off by default."""

    host: str = "127.0.0.1"
    http_port: int = 0  # Dynamo standalone indexer / Mooncake KV Indexer RFC HTTP API (0: off, -1: any free port)
    grpc_port: int = 0  # llm-d IndexerService.GetPodScores over gRPC (0: off, -1: any; the `indexer` extra)
    max_query_tokens: int = 262_144  # one query's token ids or hashes (bounds its work on the loop)


class AdvancedConfig(_Cfg):
    """Internal limits and tuning: safe defaults, overridable, not needed to run a cluster."""

    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    # "malloc": the controller restarts itself under PYTHONMALLOC=malloc (trade-off: controller/memory.py)
    allocator: str = "pymalloc"

    def __post_init__(self) -> None:
        if self.allocator not in ("malloc", "pymalloc"):
            raise ValueError(f"allocator: must be 'malloc' or 'pymalloc', got {self.allocator!r}")


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
    replicas: ReplicasConfig = msgspec.field(default_factory=ReplicasConfig)
    snapshot: SnapshotConfig = msgspec.field(default_factory=SnapshotConfig)
    peer_apis: PeerApisConfig = msgspec.field(default_factory=PeerApisConfig)
    advanced: AdvancedConfig = msgspec.field(default_factory=AdvancedConfig)

    @property
    def limits(self) -> LimitsConfig:
        """``advanced.limits``: what a peer may send."""
        return self.advanced.limits

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for inst in self.instances:
            if inst.id in seen:
                raise ValueError(f"duplicate instance id {inst.id!r}")
            seen.add(inst.id)


class ConfigError(ValueError):
    """A configuration problem, with the key path it concerns."""


T = TypeVar("T")
#: Where a config comes from: a file path, or a file shipped with the package.
Source = str | Path | Traversable


def default_config_path() -> str:
    """The example controller config shipped in the package: what ``smetric controller`` and
    ``smetric gateway`` read without ``--config``, from any folder."""
    return str(packaged_config("smetric.yaml"))


def packaged_config(name: str) -> Traversable:
    """A file shipped under the package's ``configs/`` (``"sim.yaml"``, ``"profiles/<name>.yaml"``)."""
    return resources.files("smetric_lmc.configs").joinpath(name)


def _humanize(exc: msgspec.ValidationError, source: str) -> ConfigError:
    # msgspec says "Expected `int`, got `str` - at `$.policy.overload`": lead with the key path.
    text = str(exc)
    reason, _, where = text.partition(" - at `")
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    # A __post_init__ check names its field as "field: why": fold it into the key path.
    field_, sep, why = reason.partition(": ")
    if sep and field_.isidentifier():
        path, reason = f"{path}.{field_}" if path else field_, why
    return ConfigError(f"{source}: {path or '<top level>'}: {reason}")


def _name(source: Source) -> str:
    return str(source) if isinstance(source, str | Path) else f"<package>/configs/{source.name}"


def read_yaml(source: Source) -> dict[str, Any]:
    """The mapping in a YAML file (empty file: {}); ConfigError for a file that cannot be read (a
    given path that does not exist included), invalid YAML (with line and column) or a non-mapping."""
    name = _name(source)
    src = Path(source) if isinstance(source, str) else source
    try:
        text = src.read_text()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{name}: {where}invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: <top level>: expected a mapping, got {type(data).__name__}")
    return data


#: Old spellings of controller keys, still read: (where it was, where it is now).
MOVED_KEYS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("limits",), ("advanced", "limits")),
    (("server", "allocator"), ("advanced", "allocator")),
)


def _moved_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` with each old spelling of ``MOVED_KEYS`` moved to its new place, with a warning;
    ConfigError when a file gives both."""
    for old, new in MOVED_KEYS:
        parent = data
        for key in old[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None  # type: ignore[assignment]
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}  # never edit the caller's
        parent = data
        for key in old[:-1]:
            parent = parent[key]
        target = data.setdefault(new[0], {})
        if not isinstance(target, dict):
            continue  # the converter reports the bad `advanced` with its key path
        target = data[new[0]] = dict(target)
        if new[-1] in target:
            raise ConfigError(f"{source}: {'.'.join(old)}: also given as {'.'.join(new)}; keep only the latter")
        target[new[-1]] = parent.pop(old[-1])
        log.warning("%s: %s is deprecated: write it as %s", source, ".".join(old), ".".join(new))
    return data


def parse_as(data: Any, kind: type[T], source: str = "<config>") -> T:
    """``data`` converted to the msgspec-typed ``kind``; ConfigError with the key path and reason."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: <top level>: expected a mapping, got {type(data).__name__}")
    if kind is Config:
        data = _moved_keys(data, source)
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise _humanize(exc, source) from None


def load_yaml(source: Source, kind: type[T], overrides: dict[str, Any] | None = None) -> T:
    """Read ``source`` as ``kind``; top-level ``overrides`` (None values skipped) win over the file."""
    data = read_yaml(source)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return parse_as(data, kind, _name(source))


def parse_config(data: Any, source: str = "<config>") -> Config:
    return parse_as(data, Config, source)


def load_config(path: str | Path) -> Config:
    """Load and validate a controller config; raises ConfigError with the key path and reason."""
    return load_yaml(path, Config)
