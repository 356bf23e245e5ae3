"""Typed configuration (``configs/smetric.yaml``) and the one YAML loader every config file uses.

Every field has the default DESIGN.md gives; unknown keys are errors, and a bad file fails with
the key path and the reason (``ConfigError``), never a traceback from deep inside. The controller
config, the simulator config and the hardware profiles are all read through :func:`read_yaml` /
:func:`load_yaml`; the files under ``configs/`` ship with the package (:func:`packaged_config`).
"""

from __future__ import annotations

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
from smetric_lmc.policy import policy_names


class _Cfg(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class PolicyConfig(_Cfg):
    name: str = "smetric"  # one of POLICY_NAMES (every policy registered in smetric_lmc.policy)
    overload: float = 2.0  # SMetric OVERLOAD; use .inf to never shed
    hit_ratio: float = 0.5  # SMetric HIT_RATIO
    bailian_lambda: float = 0.9  # weight of the miss term in the bailian linear score
    lmetric_load_offset: float = 1.0  # (L - c) * (l + offset): idle instances do not all tie at 0
    # smetric_cost (our variant; hit_ratio above labels its moves): share of a computed token's cost
    # that fetching it from the global tier saves
    cost_fetch_discount: float = 0.9
    # smetric_ect (expected completion cost, µs): prefill per token = ect_prefill_us + ect_prefill_us_per_ktok
    # x context/1000; a fetched token; one in-flight request's drag (smetric_ect.py says where they come from)
    ect_prefill_us: float = 110.0
    ect_prefill_us_per_ktok: float = 8.8
    ect_fetch_us: float = 4.0
    ect_inflight_us: float = 5_000_000.0
    ect_displace: float = 0.0  # share of the KV a move evicts on its target that is reused later
    ect_slack_s: float = 1.0  # queued prefill waited for free: ect_slack_s + ect_slack_s_per_tok x prompt
    ect_slack_s_per_tok: float = 1.0e-4
    # weight of the in-flight drag and of the queue term when the global tier holds none of the prefix
    # (0: the cost is then LMetric's score x the prefill cost per token)
    ect_drag_no_global: float = 0.0
    ect_queue_no_global: float = 0.0

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
        if not 0 <= self.cost_fetch_discount <= 1:
            raise ValueError("cost_fetch_discount must be within [0, 1]")
        for k in ("ect_prefill_us", "ect_prefill_us_per_ktok", "ect_fetch_us", "ect_inflight_us", "ect_displace",
                  "ect_slack_s", "ect_slack_s_per_tok", "ect_drag_no_global", "ect_queue_no_global"):
            if not getattr(self, k) >= 0:
                raise ValueError(f"{k} must be >= 0")


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
    # "malloc": the controller restarts itself under PYTHONMALLOC=malloc (trade-off: controller/memory.py)
    allocator: str = "pymalloc"

    def __post_init__(self) -> None:
        if self.allocator not in ("malloc", "pymalloc"):
            raise ValueError(f"allocator must be 'malloc' or 'pymalloc', got {self.allocator!r}")
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
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    replicas: ReplicasConfig = msgspec.field(default_factory=ReplicasConfig)
    snapshot: SnapshotConfig = msgspec.field(default_factory=SnapshotConfig)

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


def parse_as(data: Any, kind: type[T], source: str = "<config>") -> T:
    """``data`` converted to the msgspec-typed ``kind``; ConfigError with the key path and reason."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: <top level>: expected a mapping, got {type(data).__name__}")
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
