"""Reading an engine's /metrics: only the families the controller reads reach the parser, and what
it reads from a full vLLM-shaped body is what the parser finds over the whole body."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smetric_lmc.controller.engine_metrics import EngineMetricsError, parse_engine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from engine_metrics import vllm_body  # noqa: E402


def _sum(text: str, family: str, sample: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == family
               for s in f.samples if s.name == sample)


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_vllm_shaped_body_reads_as_the_whole_body_parsed(ranks: int) -> None:
    text = vllm_body(ranks, seed=ranks)
    s = parse_engine_metrics(text)
    run = _sum(text, "vllm:num_requests_running", "vllm:num_requests_running")
    wait = _sum(text, "vllm:num_requests_waiting", "vllm:num_requests_waiting")
    itl = "vllm:inter_token_latency_seconds"
    rt = "lmcache:time_to_retrieve"
    assert (s.requests, s.waiting, s.running) == (round(run + wait), round(wait), run)
    assert (s.itl_sum_s, s.itl_count) == pytest.approx((_sum(text, itl, itl + "_sum"), _sum(text, itl, itl + "_count")))
    assert s.itl_count == 50 * ranks
    assert (s.retrieve_sum_s, s.retrieve_count) == pytest.approx((_sum(text, rt, rt + "_sum"), _sum(text, rt, rt + "_count")))
    assert s.retrieved_tokens == _sum(text, "lmcache:num_hit_tokens", "lmcache:num_hit_tokens_total") == 4096 * ranks


def test_a_family_not_read_cannot_spoil_the_reading_and_garbage_is_still_an_error() -> None:
    good = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 3\n"
            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 1\n")
    # a malformed line of a family the controller does not read is never parsed
    assert parse_engine_metrics(good + "vllm:some_other_family{engine=\"0\" 1 2 3\n").requests == 4
    with pytest.raises(EngineMetricsError, match="unparsable"):  # a malformed line it reads
        parse_engine_metrics(good + "vllm:num_requests_running{engine=\"1\" oops\n")
    with pytest.raises(EngineMetricsError):
        parse_engine_metrics("<html>not metrics</html>")
