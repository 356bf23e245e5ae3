"""Issue 21 item 8: what the docs and the sample config say matches what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from smetric_lmc.cli import build_parser
from smetric_lmc.config import POLICY_NAMES, ServerConfig
from smetric_lmc.workers import launch

REPO = Path(__file__).resolve().parents[1]


def test_sample_config_names_every_policy() -> None:
    text = (REPO / "configs" / "smetric.yaml").read_text()
    block = text[text.index("  name: smetric"):text.index("overload:")]
    listed = set(re.findall(r"\b[a-z_]+\b", block.split("#", 1)[1]))
    assert set(POLICY_NAMES) <= listed, set(POLICY_NAMES) - listed


def test_worker_kv_event_ports_avoid_the_controllers_route_port() -> None:
    route_ports = {int(ServerConfig().route_url.rsplit(":", 1)[1]),
                   build_parser(["up"]).parse_args(["up"]).route_port}
    kv = launch.launch_parser().parse_args(["--model", "m"]).kv_events_port
    assert all(not (kv <= r < kv + 64) for r in route_ports), (kv, route_ports)  # 64 workers' worth
    assert f"tcp://*:{kv}" in (REPO / "docs" / "deploy.md").read_text()
