"""The controller's one state view, and the three renderings of it: ``/healthz``, the stats
reply's extras and the Prometheus families.

Each reading takes one ``StateView`` (membership rows joined with load and engine-metrics state,
subscriber counters, part counters); health, stats and metrics only pick from it, so a figure
such as ``seconds_since_seen`` is computed in one place.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from smetric_lmc.controller.membership import Membership
from smetric_lmc.controller.metrics import InstanceState, StateView, SubscriberState
from smetric_lmc.controller.service import RouteCore, RouteService
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker


class ControllerState:
    """Reads the running parts; holds nothing of its own but the start time.

    The parts that start late (LMCache server, global tier, poller) are read through ``parts``,
    the wiring's live mapping, so a view taken at any time sees what exists then.
    """

    def __init__(
        self,
        membership: Membership,
        index: TierIndex,
        load: LoadTracker,
        core: RouteCore,
        service: RouteService,
        parts: Any,
        *,
        pd_mode: str,
        global_kind: str,
        policy_name: Callable[[], str],
        counters: Callable[[], Mapping[str, Any]],
    ) -> None:
        self.membership = membership
        self.index = index
        self.load = load
        self.core = core
        self.service = service
        self.parts = parts  # the ControllerApp: subscribers, poller, lmcache_server, global_tier
        self.pd_mode = pd_mode
        self.global_kind = global_kind
        self._policy_name = policy_name
        self._counters = counters  # {"reloads": ..., "snapshot": ...} of persistence and reload
        self.started = 0.0

    def global_store_state(self) -> str:
        if self.global_kind == "none":
            return "none"
        tier = self.parts.global_tier
        if tier is None:
            return f"{self.global_kind}:unavailable"
        return f"{self.global_kind}:up" if getattr(tier, "available", False) else f"{self.global_kind}:down"

    # ---- the view ---------------------------------------------------------------------------------
    def instances(self, now: float | None = None) -> list[InstanceState]:
        poller = self.parts.poller
        rows = []
        for m in self.membership.rows(now):
            st = poller.state.get(m.id) if poller is not None else None
            rows.append(InstanceState(
                id=m.id,
                routable=m.routable,
                in_flight=self.load.in_flight(m.id),
                unprefilled_tokens=self.load.unprefilled(m.id),
                seconds_since_seen=m.seconds_since_seen,
                engine_metrics_ok=st.ok if st is not None else None,
                engine_poll_failures=st.failures if st is not None else 0,
                healed_done=st.healed if st is not None else 0,
                breaker_open=m.breaker_open,
                breaker_trips=m.breaker_trips,
            ))
        return rows

    def view(self) -> StateView:
        subs = []
        for iid, sub in self.parts.subscribers.items():
            s = sub.stats
            subs.append(SubscriberState(
                instance=iid, events=dict(s.events), batches=s.batches, gaps=s.gaps, replays=s.replays,
                replay_failures=s.replay_failures, unfilled_gaps=s.unfilled_gaps, restarts=s.restarts,
                decode_errors=s.decode_errors, bad_frames=s.bad_frames, oversize_batches=s.oversize_batches,
                offloaded=s.offloaded, large_on_loop=s.large_on_loop, worker_failures=s.worker_failures,
                lag_s=s.lag_s,
            ))
        components: dict[str, dict[str, Any]] = {"route_socket": dict(self.service.counters),
                                                  "service": dict(self.core.counters)}
        for name, part in self._stat_parts().items():
            components[name] = _flat_numbers(_builtins(getattr(part, "stats", {})))
        return StateView(
            instances=self.instances(),
            subscribers=subs,
            index_ready=self.core.index_ready,
            index_sizes=self.index.sizes(),
            index_stats=dict(self.index.stats),
            global_available=None if self.global_kind == "none" else self.global_store_state().endswith(":up"),
            components=components,
        )

    def _stat_parts(self) -> dict[str, Any]:
        parts = {"lmcache": self.parts.lmcache_server, "global_tier": self.parts.global_tier}
        return {k: v for k, v in parts.items() if v is not None}

    # ---- renderings -------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``/healthz``'s JSON."""
        h = self.core.health()
        return {
            "ok": h.ok,
            "routable_instances": h.routable_instances,
            "index_ready": h.index_ready,
            "degraded": not h.index_ready,
            "global_store": h.global_store,
            "policy": self._policy_name(),
            "instances": {
                r.id: {"routable": r.routable, "seconds_since_seen": r.seconds_since_seen,
                       "engine_metrics_ok": r.engine_metrics_ok if self.parts.poller is not None else None}
                for r in self.instances()
            },
        }

    def stats_extra(self) -> dict[str, Any]:
        """What the stats reply adds to the route core's own figures."""
        now = time.monotonic()
        out: dict[str, Any] = {
            "uptime_s": round(now - self.started, 3) if self.started else 0.0,
            "pd_mode": self.pd_mode,
            "global_store": self.global_store_state(),
            "route_socket": {**self.service.counters, **self.service.curve_counts},
            **{k: dict(v) for k, v in self._counters().items()},
            "liveness": {
                r.id: {"routable": r.routable, "seconds_since_seen": r.seconds_since_seen,
                       "breaker_open": r.breaker_open, "breaker_trips": r.breaker_trips}
                for r in self.instances(now)
            },
            "kv_events": {iid: dataclasses.asdict(s.stats) for iid, s in self.parts.subscribers.items()},
        }
        poller = self.parts.poller
        if poller is not None:
            out["engine_metrics"] = {
                iid: {k: v for k, v in dataclasses.asdict(st).items() if k != "last_ok"}
                for iid, st in poller.state.items()
            }
        for name, part in self._stat_parts().items():
            out[name] = _builtins(getattr(part, "stats", {}))
        return _builtins(out)


def _builtins(obj: Any) -> Any:
    """Plain msgpack/JSON-able data out of whatever a part reports (dataclasses, structs, sets)."""
    if callable(obj):
        try:
            obj = obj()
        except Exception:
            return {}
    return msgspec.to_builtins(obj, str_keys=True, enc_hook=repr)


def _flat_numbers(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {k: v for k, v in d.items() if isinstance(v, bool | int | float)}
