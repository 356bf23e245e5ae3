"""What reading one engine's ``/metrics`` costs the controller's event loop.

    python bench/engine_metrics.py            # a vLLM-shaped body, 200 parses each way
    python bench/engine_metrics.py --ranks 4  # four data-parallel engines behind one endpoint

The body has vLLM's v1 metric families (names, label sets and default histogram buckets as vLLM's
``vllm/v1/metrics/loggers.py`` and ``buckets.py`` define them, max_model_len 32768), LMCache's
retrieve metrics and the Python process collectors, with made-up values. The controller reads five
of those families; ``parse_engine_metrics`` hands only their lines to the Prometheus parser. The
comparison is the same parser over the whole body (what the poller did before).

Prints a human-readable report, then ONE JSON line:
``{"body_kib", "lines", "parse_ms", "full_parse_ms", "speedup", "loop_share_32_engines_2s"}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from smetric_lmc.controller.engine_metrics import parse_engine_metrics  # noqa: E402

# vLLM's default bucket bounds per family (vllm.v1.metrics.buckets.histogram_buckets).
REQUEST_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0]
PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
HISTOGRAMS = [
    ("vllm:request_prompt_tokens", REQUEST_TOKENS), ("vllm:request_generation_tokens", REQUEST_TOKENS),
    ("vllm:iteration_tokens_total", ITERATION_TOKENS), ("vllm:request_max_num_generation_tokens", REQUEST_TOKENS),
    ("vllm:request_params_n", PARAMS_N), ("vllm:request_params_max_tokens", REQUEST_TOKENS),
    ("vllm:time_to_first_token_seconds", TTFT), ("vllm:inter_token_latency_seconds", ITL),
    ("vllm:request_time_per_output_token_seconds", ITL), ("vllm:e2e_request_latency_seconds", LATENCY),
    ("vllm:request_queue_time_seconds", LATENCY), ("vllm:request_inference_time_seconds", LATENCY),
    ("vllm:request_prefill_time_seconds", LATENCY), ("vllm:request_decode_time_seconds", LATENCY),
    ("vllm:request_num_preemptions", PREEMPTIONS), ("vllm:request_prefill_kv_computed_tokens", REQUEST_TOKENS),
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
COUNTERS = ["vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
            "vllm:prompt_tokens_cached", "vllm:generation_tokens"]
FINISH_REASONS = ("stop", "length", "abort", "error")


def vllm_body(ranks: int, seed: int = 0) -> str:
    """Prometheus text shaped like a vLLM engine's /metrics with LMCache loaded."""
    rng = random.Random(seed)
    reg = CollectorRegistry()
    from prometheus_client.gc_collector import GCCollector
    from prometheus_client.platform_collector import PlatformCollector
    from prometheus_client.process_collector import ProcessCollector

    GCCollector(registry=reg)
    PlatformCollector(registry=reg)
    ProcessCollector(registry=reg)
    labels = ["model_name", "engine"]
    model = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    for name in GAUGES:
        g = Gauge(name, name, labels, registry=reg)
        for e in range(ranks):
            g.labels(model, str(e)).set(rng.randint(0, 64))
    for name in COUNTERS:
        c = Counter(name, name, labels, registry=reg)
        for e in range(ranks):
            c.labels(model, str(e)).inc(rng.randint(0, 10**8))
    ok = Counter("vllm:request_success", "finished", [*labels, "finished_reason"], registry=reg)
    for e in range(ranks):
        for r in FINISH_REASONS:
            ok.labels(model, str(e), r).inc(rng.randint(0, 10**5))
    for name, buckets in HISTOGRAMS:
        h = Histogram(name, name, labels, buckets=buckets, registry=reg)
        for e in range(ranks):
            child = h.labels(model, str(e))
            for _ in range(50):
                child.observe(rng.choice(buckets) * rng.random() * 1.5)
    lmc = ["model_name", "worker_id"]
    rt = Histogram("lmcache:time_to_retrieve", "retrieve", lmc, registry=reg,
                   buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0])
    hit = Counter("lmcache:num_hit_tokens", "hit", lmc, registry=reg)
    for w in range(ranks):
        rt.labels(model, str(w)).observe(0.05)
        hit.labels(model, str(w)).inc(4096)
    return generate_latest(reg).decode()


def _time(fn, text: str, reps: int) -> float:
    fn(text)  # warm
    t = time.perf_counter()
    for _ in range(reps):
        fn(text)
    return (time.perf_counter() - t) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1, help="data-parallel engines behind one /metrics")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    text = vllm_body(args.ranks)
    s = parse_engine_metrics(text)
    assert s.itl_count is not None and s.retrieve_count is not None, "the body lacks what the poller reads"
    # Interleaved rounds: both ways see the same machine drift.
    fast, full = [], []
    for _ in range(5):
        fast.append(_time(parse_engine_metrics, text, args.reps // 5))
        full.append(_time(lambda t: list(text_string_to_metric_families(t)), text, args.reps // 5))
    fast_ms, full_ms = min(fast), min(full)
    share = 32 * fast_ms / 2000  # 32 engines polled every 2 s (LoadConfig.metrics_poll_s)
    print(f"body: {len(text) / 1024:.1f} KiB, {text.count(chr(10))} lines, {args.ranks} rank(s)")
    print(f"parse_engine_metrics: {fast_ms:.3f} ms; the parser over the whole body: {full_ms:.3f} ms "
          f"({full_ms / fast_ms:.1f}x); best of 5 rounds of {args.reps // 5}")
    print(f"32 engines polled every 2 s: {100 * share:.2f}% of the event loop (before: "
          f"{100 * 32 * full_ms / 2000:.2f}%)")
    print(json.dumps({"body_kib": round(len(text) / 1024, 1), "lines": text.count("\n"),
                      "parse_ms": round(fast_ms, 4), "full_parse_ms": round(full_ms, 4),
                      "speedup": round(full_ms / fast_ms, 1), "loop_share_32_engines_2s": round(share, 5)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
