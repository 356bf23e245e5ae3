"""``smetric up`` without its vLLM engines: the banner and the port check before start-up."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from smetric_lmc.cli import build_parser
from smetric_lmc.workers import launch, up


def _stack(tmp_path: Path) -> up.LocalStack:
    engines = [SimpleNamespace(instance_id=f"vllm-{i}", http_url=f"http://127.0.0.1:{8000 + i}", model="tiny",
                               process=SimpleNamespace(log_path=tmp_path / f"vllm-{i}.log")) for i in range(2)]
    procs = [launch.ProcessGroup(["true"], {}, tmp_path / f"{n}.log", n) for n in ("controller", "gateway")]
    return up.LocalStack(engines, tmp_path / "smetric.yaml", "http://127.0.0.1:8080",  # type: ignore[arg-type]
                         "http://127.0.0.1:9600/metrics", procs, route_url="tcp://127.0.0.1:5600", policy="smetric")


def test_banner_names_every_url_and_every_log(tmp_path: Path) -> None:
    text = up.banner(_stack(tmp_path))
    for needle in ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/metrics", "http://127.0.0.1:9600/metrics",
                   "http://127.0.0.1:9600/healthz", "tcp://127.0.0.1:5600", str(tmp_path / "smetric.yaml"),
                   str(tmp_path / "vllm-0.log"), str(tmp_path / "vllm-1.log"), str(tmp_path / "controller.log"),
                   str(tmp_path / "gateway.log"), "X-SMetric-Index-Ready: false", "policy smetric"):
        assert needle in text, needle


def test_fixed_default_ports_and_a_taken_one_fails_before_engines_start() -> None:
    args = build_parser(["up"]).parse_args(["up"])
    assert (args.port, args.metrics_port, args.route_port) == (8080, 9600, 5600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"metrics port {taken}"):
            up.check_ports("127.0.0.1", {"gateway": 0, "metrics": taken, "route": 0})
    up.check_ports("127.0.0.1", {"gateway": 0, "metrics": taken, "route": 0})  # free again
