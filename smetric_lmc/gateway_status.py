"""The gateway's status page (``GET /``): one readable HTML page on the running cluster.

What it shows comes from the controller (``stats`` and ``instances`` over the route socket: each
instance's state and load, the index's size per tier, the policy and its parameters) and from the
gateway itself (routes it answered, by reason). It refreshes itself every few seconds; when the
controller does not answer it says so and still shows the gateway's side.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from smetric_lmc.wire import InstanceInfo

REFRESH_S = 5
# Index size per tier, from the controller's stats["index"].
_TIERS = (("GPU (vLLM prefix cache)", "gpu_nodes", "blocks"),
          ("LMCache local (CPU/disk)", "lmcache_chunks", "chunks"),
          ("global store", "global_chunks", "chunks"))
# The policy parameters each policy reads (the others in the section are other policies').
_PARAMS = {
    "smetric": ("overload", "hit_ratio"),
    "bailian": ("bailian_lambda",),
    "lmetric": ("lmetric_load_offset",),
}

_CSS = ("body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;"
        "margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .7em;text-align:right}"
        "th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.bad{color:#b00;font-weight:bold}"
        ".ok{color:#070}code{background:#f3f3f3;padding:0 .2em}")


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{trs}</table>"


def _num(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else html.escape(str(x))


def render(
    *,
    controller_url: str,
    stats: Mapping[str, Any] | None,
    instances: Sequence[InstanceInfo] | None,
    controller_error: str | None,
    reasons: Mapping[str, int],
    gateway_counters: Mapping[str, int],
) -> str:
    """The page's HTML. ``stats``/``instances`` are None when the controller did not answer."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{REFRESH_S}'>"
             f"<title>smetric gateway</title><style>{_CSS}</style></head><body><h1>smetric gateway</h1>"]
    if stats is None:
        parts.append(f"<p class='bad'>controller at <code>{e(controller_url)}</code> does not answer: "
                     f"{e(controller_error or '?')}. Requests are routed round-robin meanwhile.</p>")
    else:
        policy = dict(stats.get("policy") or {})
        name = str(policy.get("name", "?"))
        shown = {k: policy[k] for k in _PARAMS.get(name, ()) if k in policy}
        shown.update(policy.get("params") or {})  # an experimental policy's own parameters (smetric_ect)
        params = ", ".join(f"{k} = {_num(v)}" for k, v in shown.items()) or "none"
        ready = stats.get("index_ready")
        parts.append(
            f"<p>controller <code>{e(controller_url)}</code>, up {float(stats.get('uptime_s') or 0):,.0f} s, "
            f"{e(str(stats.get('pd_mode', '?')))}, global store {e(str(stats.get('global_store', '?')))}</p>"
            f"<p>policy <b>{e(name)}</b> ({e(params)}); index "
            + ("<span class='ok'>ready</span>" if ready else
               "<span class='bad'>not ready: routing by load until the engines' first KV events</span>") + "</p>")
        live = stats.get("liveness") or {}
        rows = []
        for i in instances or ():
            lv = live.get(i.id) or {}
            state = "<span class='ok'>routable</span>" if i.routable else "<span class='bad'>out of routing</span>"
            if lv.get("breaker_open"):
                state += " (breaker open)"
            seen = lv.get("seconds_since_seen")
            rows.append([e(i.id), e(i.endpoint), e(i.role), state, _num(i.in_flight), _num(i.unprefilled_tokens),
                         _num(i.indexed_blocks), "–" if seen is None else f"{float(seen):.1f}"])
        parts.append("<h2>Instances</h2>" + _table(
            ["instance", "endpoint", "role", "state", "in flight (requests)", "unprefilled (tokens)",
             "GPU blocks indexed", "last seen (s ago)"], rows))
        index = stats.get("index") or {}
        parts.append("<h2>Index size per tier</h2>" + _table(
            ["tier", "entries"], [[e(t), f"{_num(index.get(k, 0))} {u}"] for t, k, u in _TIERS]))
        svc = stats.get("service") or {}
        parts.append(f"<p>controller: {_num(svc.get('route', 0))} routes answered, "
                     f"{_num(svc.get('degraded_routes', 0))} while the index was not ready, "
                     f"{_num(svc.get('errors', 0))} errors; {_num(stats.get('in_flight', 0))} requests in flight</p>")
        parts.append("<h2>Policy parameters</h2>" + _table(
            ["parameter", "value"], [[e(k), _num(v)] for k, v in policy.items() if k != "name"]))
    total = sum(reasons.values())
    parts.append("<h2>Routes by reason (this gateway)</h2>" + _table(
        ["reason", "requests", "share"],
        [[e(r), _num(n), f"{n / total:.1%}"] for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])]))
    parts.append("<p>gateway: " + ", ".join(f"{e(k)} {_num(v)}" for k, v in gateway_counters.items()) + "</p>")
    parts.append("<p>Also: <a href='/metrics'>/metrics</a> (Prometheus), <a href='/healthz'>/healthz</a>, "
                 "<a href='/v1/models'>/v1/models</a>.</p></body></html>")
    return "".join(parts)
