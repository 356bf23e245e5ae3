"""The engine-metrics poller reads LMCache's retrieve metrics as LMCache 0.5.6 itself writes them:
its own stats monitor and Prometheus logger (in the engine venv, CPU) record retrieves, and the
text vLLM's /metrics would serve (prometheus_client's multiprocess collector, the mode LMCache sets up
in the engine process) goes through our parser and per-poll deltas."""

from __future__ import annotations

import json

import pytest
from kit.lmcache_venv import run_in_lmcache_venv

from smetric_lmc.controller.engine_metrics import RetrieveDeltas, parse_engine_metrics

_LMCACHE_RETRIEVES = r"""
import json, os, sys, tempfile, time
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
import torch
from lmcache import observability as O
from lmcache.v1.metadata import LMCacheMetadata
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

md = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                     kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 1, 8))
logger, monitor = O.PrometheusLogger(md), O.LMCStatsMonitor()

def scrape():
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    return generate_latest(reg).decode()

out = []
for batch in json.loads(sys.stdin.read()):
    for asked, got, secs in batch:
        s = monitor.on_retrieve_request(asked)
        time.sleep(secs)
        monitor.on_retrieve_finished(s, got)
    logger.log_prometheus(monitor.get_stats_and_clear())
    out.append(scrape())
print(json.dumps(out))
"""

_GAUGE = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n'


@pytest.mark.integration
def test_lmcache_own_retrieve_metrics_become_retrieve_observations() -> None:
    batches = [[[512, 512, 0.01]], [[1024, 768, 0.03], [2048, 2048, 0.05]], []]
    texts = json.loads(run_in_lmcache_venv(_LMCACHE_RETRIEVES, stdin=json.dumps(batches).encode(), timeout=180))
    d = RetrieveDeltas()
    samples = [parse_engine_metrics(_GAUGE + t) for t in texts]
    assert samples[0].retrieve_count == 1 and samples[0].retrieved_tokens == 512
    assert d.update("i", samples[0]) is None  # the first poll is the baseline
    count, mean_s, mean_tokens = d.update("i", samples[1])  # type: ignore[misc]
    # two retrieves, of 768 and 2,048 tokens, that took at least 30 and 50 ms
    assert count == 2 and mean_tokens == pytest.approx((768 + 2048) / 2)
    assert 0.04 <= mean_s < 0.5
    assert d.update("i", samples[2]) is None  # none since
