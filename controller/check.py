"""``smetric controller --check CONFIG``: validate a config and show what the controller would run with.

Everything printed is resolved the way the controller resolves it at start (hash chain roots,
which tiers are indexed, every socket it binds or connects), without opening any of them. The
warnings point at settings that load fine but route badly; each names its fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlparse

import msgspec

from smetric_lmc.config import Config
from smetric_lmc.hashing import fast_root, lmcache_root_of

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _kv(struct: msgspec.Struct) -> str:
    # None: a deprecated spelling that was not given (its value, if any, moved to its new key)
    return " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(struct).items() if v is not None)


def _lmcache_root(cfg: Config) -> str:
    h = cfg.hashing
    try:
        value = lmcache_root_of(h)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"hashing.lmcache_root={h.lmcache_root!r}: {exc}") from exc
    how = "" if isinstance(h.lmcache_root, int) else f" (from {h.lmcache_root!r}, seed {h.lmcache_root_seed!r})"
    return f"{value:#018x}{how}"


def describe(cfg: Config, source: str) -> list[str]:
    """The resolved settings, one line each (raises ValueError for settings that cannot resolve)."""
    h, srv, lc, gs = cfg.hashing, cfg.server, cfg.lmcache, cfg.global_store
    chunks = lc.enabled or gs.kind != "none"
    lines = [
        f"config {source}: valid",
        f"model: {cfg.model or '(any)'}   pd_mode: {cfg.pd_mode}",
        f"policy: {_kv(cfg.policy)}",
        "hashing:",
        f"  GPU tier: block_size={h.block_size} "
        f"fast chain root={fast_root(h.fast_namespace):#018x} (fast_namespace {h.fast_namespace!r})",
    ]
    if chunks:
        lines.append(f"  LMCache/global tier: chunk_size={h.lmcache_chunk_size} lmcache_hash={h.lmcache_hash} "
                     f"chain root={_lmcache_root(cfg)}")
    else:
        lines.append("  LMCache/global tier: not indexed (lmcache.enabled is false and global_store.kind is none)")
    curve = "on" if srv.curve_secret_key else "off"
    lines += [
        "sockets:",
        f"  route (ZMQ, bind): {srv.route_url}   CURVE: {curve}",
        f"  metrics + healthz (HTTP, bind): http://{srv.metrics_host}:{srv.metrics_port}/metrics",
    ]
    if lc.enabled:
        lines.append(f"  LMCache workers (ZMQ, bind): pull={lc.pull_url} reply={lc.reply_url} "
                     f"heartbeat={lc.heartbeat_url or 'off'}")
        if lc.upstream_pull_url:
            lines.append(f"  LMCache upstream (ZMQ, connect): pull={lc.upstream_pull_url} reply={lc.upstream_reply_url}")
    else:
        lines.append("  LMCache workers: off")
    if gs.kind == "none":
        lines.append("  global store: none")
    else:
        where = gs.url if gs.kind == "redis" else f"events={gs.events_endpoint} master={gs.master_http}"
        lines.append(f"  global store: {gs.kind} {where} model={gs.model or cfg.model!r} world_size={gs.world_size}")
    lines.append(f"instances ({len(cfg.instances)}):")
    for i in cfg.instances:
        events = f"{'bind' if i.kv_events_bind else 'connect'} {i.kv_events}" if i.kv_events else "none"
        lines.append(f"  {i.id}: http={i.http} kv_events={events} topic={i.kv_events_topic!r} "
                     f"replay={i.replay or 'none'} role={i.role} node={i.node}")
    lines.append(f"load: {_kv(cfg.load)}")
    return lines


def warnings(cfg: Config) -> Iterator[str]:
    """Settings that are valid but leave routing blind or exposed."""
    if not cfg.instances:
        yield "no instances: every route answers no_instances"
    for i in cfg.instances:
        if not i.kv_events:
            yield (f"instance {i.id}: no kv_events endpoint, so its GPU cache is never indexed and nothing "
                   "sticks to it (set kv_events to vLLM's --kv-events-config endpoint)")
    endpoints = [i.kv_events for i in cfg.instances if i.kv_events]
    for e in sorted({e for e in endpoints if endpoints.count(e) > 1}):
        yield f"kv_events endpoint {e} is shared by several instances: their blocks would be mixed up"
    h = cfg.hashing
    if isinstance(h.lmcache_root, str) and h.lmcache_root.startswith("vllm_") and h.lmcache_root_seed is None:
        yield ("hashing.lmcache_root depends on the engines' PYTHONHASHSEED but lmcache_root_seed is unset: "
               "this process's environment is used; set it to the workers' value")
    host = urlparse(cfg.server.route_url.replace("tcp://", "http://", 1)).hostname or ""
    if host not in _LOOPBACK and not cfg.server.curve_secret_key:
        yield f"server.route_url {cfg.server.route_url} is not loopback and CURVE is off: anyone can route"
    if cfg.load.metrics_poll_s <= 0:
        also = "" if cfg.lmcache.enabled else " and silent instances never leave routing"
        yield f"load.metrics_poll_s is 0: load left by lost done reports is never healed{also}"


def check(cfg: Config, source: str) -> tuple[list[str], list[str]]:
    """(settings lines, warning lines); raises ValueError for a setting that cannot resolve."""
    return describe(cfg, source), list(warnings(cfg))


__all__ = ["check", "describe", "warnings"]
