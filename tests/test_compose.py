"""deploy/compose: Prometheus + Grafana with the SMetric dashboard against `smetric up`.

Docker is not available where these tests run, so the containers are not started: the compose
file, the Prometheus config and the Grafana provisioning are parsed and checked against each other,
against the paths they mount and against the ports `smetric up` uses by default.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from smetric_lmc.cli import build_parser

COMPOSE = Path(__file__).resolve().parents[1] / "deploy" / "compose"


def _yaml(name: str) -> dict:
    data = yaml.safe_load((COMPOSE / name).read_text())
    assert isinstance(data, dict), name
    return data


def test_compose_file_mounts_what_exists() -> None:
    c = _yaml("compose.yaml")
    assert set(c["services"]) == {"prometheus", "grafana"}
    for svc in c["services"].values():
        assert ":" in svc["image"] and not svc["image"].endswith(":latest")  # pinned images
        for vol in svc.get("volumes", []):
            host = vol.split(":")[0]
            assert (COMPOSE / host).exists(), vol
    assert (COMPOSE / "../../dashboards/smetric.json").is_file()
    assert c["services"]["grafana"]["depends_on"] == ["prometheus"]
    home = c["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/var/lib/grafana/dashboards/") and (COMPOSE / "../../dashboards" / Path(home).name).is_file()


def test_prometheus_scrapes_smetric_ups_default_ports() -> None:
    args = build_parser(["up"]).parse_args(["up"])
    prom = _yaml("prometheus.yml")
    targets = {job["job_name"]: t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {"smetric-gateway": f"127.0.0.1:{args.port}", "smetric-controller": f"127.0.0.1:{args.metrics_port}"}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in prom["scrape_configs"])


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    c = _yaml("compose.yaml")
    listen = next(a for a in c["services"]["prometheus"]["command"] if a.startswith("--web.listen-address="))
    (ds,) = _yaml("grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"] == "http://" + listen.split("=", 1)[1]
    (prov,) = _yaml("grafana/provisioning/dashboards/smetric.yaml")["providers"]
    mounted = {v.split(":")[1] for v in c["services"]["grafana"]["volumes"]}
    assert prov["options"]["path"] in mounted
    dash = json.loads((COMPOSE / "../../dashboards/smetric.json").read_text())
    # the dashboard's panels take the data source from its variable, which picks the default one
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == ds["type"]
