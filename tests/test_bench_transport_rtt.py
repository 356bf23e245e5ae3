"""bench/transport_rtt.py: a ZMQ and a TCP echo between two processes (a smoke run)."""

from __future__ import annotations

import json
from types import ModuleType

import pytest
from helpers import load_bench


def _bench() -> ModuleType:
    return load_bench("transport_rtt")


def test_both_transports_echo_and_one_json_line_ends_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(["--n", "30", "--gap-ms", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert out["n"] == 30 and out["gap_ms"] == 0
    for kind in ("zmq", "tcp"):
        assert 0 < out[f"{kind}_p50_us"] <= out[f"{kind}_p99_us"]
    assert out["zmq_minus_tcp_p50_us"] == pytest.approx(out["zmq_p50_us"] - out["tcp_p50_us"], abs=0.2)
    assert lines[0].startswith("[1/2] zmq") and lines[1].startswith("[2/2] tcp")


@pytest.mark.parametrize("args", [["--n", "0"], ["--gap-ms", "-1"]])
def test_bad_arguments_are_refused_in_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(args) == 2
    assert capsys.readouterr().err.startswith("transport_rtt: ")
