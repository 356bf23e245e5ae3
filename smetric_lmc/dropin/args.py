"""The command line of vLLM production-stack's router, accepted by ``smetric router``.

Every flag of production-stack's router parser (``src/vllm_router/parsers/parser.py``) is accepted
with its type and default, so the chart's router template (``helm/templates/deployment-router.yaml``,
chart ``vllm-stack`` 0.1.12) starts SMetric unchanged. What SMetric does with each:

* used: ``--host``, ``--port``, ``--service-discovery static|k8s``, ``--static-backends``,
  ``--static-models``, ``--k8s-namespace``, ``--k8s-port``, ``--k8s-label-selector``,
  ``--k8s-service-discovery-type`` (``pod-ip``), ``--k8s-watcher-timeout-seconds``,
  ``--routing-logic`` (mapped: :data:`ROUTING_LOGIC`), ``--session-key``,
  ``--lmcache-controller-port`` / ``-reply-port`` / ``-heartbeat-port`` (the LMCache worker protocol
  is spoken there), ``--lmcache-worker-timeout``, ``--root-path``, ``--log-level``;
* accepted and logged as having no effect here: the rest (batch API, callbacks, rewriters, Sentry,
  OpenTelemetry, dynamic config, PII, external providers, the request-stats window and scrape
  interval: SMetric follows engine load from its own in-flight accounting and ``/metrics`` polls).

SMetric's own options (through the chart's ``routerSpec.extraArgs``) start with ``--smetric-``.
"""

from __future__ import annotations

import argparse
from typing import Any

#: production-stack's routing logic -> SMetric policy. ``session`` / ``prefixaware`` / ``kvaware``
#: all ask for cache affinity; SMetric's rule gives it with the load guard they lack. Any SMetric
#: policy name is accepted too (``--routing-logic smetric`` in ``extraArgs``: the last one wins).
ROUTING_LOGIC = {
    "roundrobin": "round_robin",
    "session": "smetric",
    "prefixaware": "smetric",
    "kvaware": "smetric",
}
#: Production-stack logics SMetric does not implement: refused with a clear message.
UNSUPPORTED_LOGIC = ("disaggregated_prefill", "disaggregated_prefill_orchestrated")

#: Flags accepted for compatibility whose values SMetric does not use (dest names).
NO_EFFECT = (
    "static_aliases", "static_model_types", "static_model_labels", "static_backend_health_checks",
    "static_backend_health_check_interval", "static_backend_health_check_timeout_seconds",
    "backend_health_check_timeout_seconds", "callbacks", "request_rewriter", "enable_batch_api",
    "file_storage_class", "file_storage_path", "batch_processor", "engine_stats_interval",
    "request_stats_window", "log_stats", "log_stats_interval", "dynamic_config_yaml", "dynamic_config_json",
    "feature_gates", "log_format", "sentry_dsn", "sentry_traces_sample_rate",
    "sentry_profile_session_sample_rate", "otel_endpoint", "otel_service_name", "otel_secure",
    "prefill_model_labels", "decode_model_labels", "kv_aware_threshold", "prefix_min_match_length",
    "max_instance_failover_reroute_attempts", "lmcache_health_check_interval", "external_providers_config",
)


def add_production_stack_arguments(p: argparse.ArgumentParser) -> None:
    """production-stack's router flags, with its types and defaults."""
    a = p.add_argument
    a("--host", type=str, default="0.0.0.0")
    a("--port", type=int, default=8001)
    a("--root-path", type=str, default="", help="serve under this path prefix too")
    a("--service-discovery", type=str, choices=["static", "k8s", "external-only"], default="static")
    a("--k8s-service-discovery-type", type=str, choices=["pod-ip", "service-name"], default="pod-ip")
    a("--static-backends", type=str, default=None, help="comma-separated engine base URLs")
    a("--static-models", type=str, default=None, help="comma-separated served model per backend")
    a("--static-aliases", type=str, default=None)
    a("--static-model-types", type=str, default=None)
    a("--static-model-labels", type=str, default=None)
    a("--static-backend-health-checks", action="store_true")
    a("--static-backend-health-check-interval", type=int, default=60)
    a("--static-backend-health-check-timeout-seconds", type=int, default=10)
    a("--k8s-port", type=int, default=8000, help="engine port on each pod")
    a("--k8s-namespace", type=str, default="default")
    a("--k8s-label-selector", type=str, default="", help="engine pods, e.g. environment=test,release=test")
    a("--k8s-watcher-timeout-seconds", type=int, default=0)
    a("--backend-health-check-timeout-seconds", type=int, default=10)
    a("--routing-logic", type=str, default="roundrobin",
      help="production-stack's roundrobin/session/prefixaware/kvaware (mapped) or any SMetric policy")
    a("--lmcache-controller-port", type=int, default=9000, help="LMCache workers' PULL port")
    a("--lmcache-controller-reply-port", type=int, default=None,
      help="LMCache workers' registration ROUTER port (SMetric default: 9001)")
    a("--lmcache-controller-heartbeat-port", type=int, default=None,
      help="LMCache workers' heartbeat ROUTER port (SMetric default: 9002)")
    a("--session-key", type=str, default=None, help="request header naming a session")
    a("--callbacks", type=str, default=None)
    a("--request-rewriter", type=str, default="noop")
    a("--enable-batch-api", action="store_true")
    a("--file-storage-class", type=str, default="local_file")
    a("--file-storage-path", type=str, default="/tmp/vllm_files")
    a("--batch-processor", type=str, default="local")
    a("--engine-stats-interval", type=int, default=30)
    a("--request-stats-window", type=int, default=60)
    a("--log-stats", action="store_true")
    a("--log-stats-interval", type=int, default=10)
    a("--dynamic-config-yaml", type=str, default=None)
    a("--dynamic-config-json", type=str, default=None)
    a("--feature-gates", type=str, default="")
    a("--log-level", type=str, default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    a("--log-format", type=str, default="text", choices=["text", "json"])
    a("--sentry-dsn", type=str, default=None)
    a("--sentry-traces-sample-rate", type=float, default=0.1)
    a("--sentry-profile-session-sample-rate", type=float, default=1.0)
    a("--otel-endpoint", type=str, default=None)
    a("--otel-service-name", type=str, default="vllm-router")
    a("--otel-secure", action="store_true", default=False)
    a("--prefill-model-labels", type=str, default=None)
    a("--decode-model-labels", type=str, default=None)
    a("--kv-aware-threshold", type=int, default=2000)
    a("--prefix-min-match-length", type=int, default=0)
    a("--max-instance-failover-reroute-attempts", type=int, default=0)
    a("--lmcache-health-check-interval", type=int, default=5)
    a("--lmcache-worker-timeout", type=int, default=30)
    a("--external-providers-config", type=str, default=None)


def add_smetric_arguments(p: argparse.ArgumentParser) -> None:
    """SMetric's own options, for ``routerSpec.extraArgs``."""
    a = p.add_argument
    a("--smetric-config", default=None,
      help="controller YAML for everything the chart does not say (hashing, global store, policy knobs)")
    a("--smetric-route-url", default="tcp://127.0.0.1:5600", help="in-process route socket")
    a("--smetric-metrics-port", type=int, default=9600, help="controller /metrics (0: off)")
    a("--smetric-indexer-http-port", type=int, default=0,
      help="Dynamo / Mooncake KV-indexer HTTP API (0: off, -1: any free port)")
    a("--smetric-indexer-grpc-port", type=int, default=0, help="llm-d GetPodScores gRPC API (0: off, -1: any free port)")
    a("--smetric-lmcache-host", default="0.0.0.0", help="address the LMCache controller ports bind")
    a("--smetric-static-ids", default=None,
      help="static: comma-separated instance ids, one per backend (default: the backends' host:port); "
      "an LMCache worker is credited to the instance whose id equals its lmcache_instance_id")
    a("--smetric-static-kv-events", default=None,
      help="static: comma-separated vLLM KV-event endpoints, one per backend (GPU tier)")
    a("--smetric-k8s-kv-events-port", type=int, default=0,
      help="k8s: each pod's vLLM KV-event PUB port (vLLM --kv-events-config endpoint; 0: no GPU tier)")
    a("--smetric-k8s-kv-replay-port", type=int, default=0, help="k8s: each pod's vLLM KV-event replay port (0: none)")
    a("--smetric-block-size", type=int, default=None, help="engines' vLLM block size (hashing.block_size)")


class ArgsError(ValueError):
    """The argument list cannot start a router; the message says why."""


def policy_for(routing_logic: str, known: tuple[str, ...]) -> str:
    if routing_logic in ROUTING_LOGIC:
        return ROUTING_LOGIC[routing_logic]
    if routing_logic in known:
        return routing_logic
    if routing_logic in UNSUPPORTED_LOGIC:
        raise ArgsError(f"--routing-logic {routing_logic}: disaggregated prefill routing is not supported by the "
                        "SMetric drop-in; use kvaware (mapped to smetric) or run `smetric controller` with pd_mode")
    raise ArgsError(f"--routing-logic {routing_logic!r}: expected one of "
                    f"{', '.join([*ROUTING_LOGIC, *known])}")


def csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def ignored(args: argparse.Namespace) -> dict[str, Any]:
    """Flags given a non-default value that have no effect here (logged at start)."""
    defaults = vars(build_parser().parse_args([]))
    return {k: v for k, v in vars(args).items() if k in NO_EFFECT and v != defaults.get(k)}


def build_parser(prog: str = "smetric router") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=True)
    add_production_stack_arguments(p)
    add_smetric_arguments(p)
    return p
