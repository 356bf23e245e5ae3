"""`smetric ... --help` shows every default; `smetric controller --check CONFIG` validates without starting."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from smetric_lmc.cli import _has_default, build_parser, main
from smetric_lmc.hashing import fast_root, lmcache_root
from smetric_lmc.workers.launch import free_ports


def _subparsers(parser: argparse.ArgumentParser, path: str = "smetric") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:  # argparse keeps its tree private; walking it is the only way
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{path} {name}")


def test_every_default_of_every_subcommand_is_in_its_help() -> None:
    parser = build_parser([])  # no subcommand named: every part registers its real parser
    seen = set()
    for path, p in _subparsers(parser):
        text = " ".join(p.format_help().split())  # unwrap the help columns
        for action in p._actions:
            if not action.option_strings or not _has_default(action.default):
                continue
            default = action.default
            shown = ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
            assert f"default: {shown}" in text, f"`{path} --help`: {action.option_strings[0]} hides its default {shown!r}"
            seen.add(f"{path} {action.option_strings[0]}")
    # The ones an operator looks for first: hosts, ports, timeouts.
    for opt in ("smetric gateway --host", "smetric gateway --port", "smetric gateway --route-timeout-s",
                "smetric up --port", "smetric up --engine-timeout-s"):
        assert opt in seen
    # --config defaults to the config shipped in the package (resolved at run time), and says so
    for part in ("controller", "gateway"):
        (sub,) = [p for path, p in _subparsers(parser) if path == f"smetric {part}"]
        assert "shipped in the package" in " ".join(sub.format_help().split())


def test_controller_help_lists_the_config_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["controller", "--help"])
    out = capsys.readouterr().out
    for line in ("server.route_url: tcp://127.0.0.1:5600", "server.metrics_port: 9600",
                 "load.instance_timeout_s: 30.0", "--check CONFIG"):
        assert line in out


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_check_prints_resolved_settings_and_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    route_port = free_ports(1)[0]
    path = _write(tmp_path, {
        "model": "tiny",
        "hashing": {"block_size": 32, "fast_namespace": "tiny", "lmcache_root": "vllm_builtin",
                    "lmcache_root_seed": "0"},
        "lmcache": {"enabled": True},
        "instances": [{"id": "a", "http": "http://127.0.0.1:8000", "kv_events": "tcp://127.0.0.1:5557"},
                      {"id": "b", "http": "http://127.0.0.1:8001"}],
        "server": {"route_url": f"tcp://127.0.0.1:{route_port}", "metrics_port": 9700},
    })
    assert main(["controller", "--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"config {path}: valid" in out
    assert f"fast chain root={fast_root('tiny'):#018x}" in out
    assert f"chain root={lmcache_root('vllm_builtin', seed='0'):#018x}" in out
    assert f"route (ZMQ, bind): tcp://127.0.0.1:{route_port}" in out
    assert "http://127.0.0.1:9700/metrics" in out
    assert "pull=tcp://127.0.0.1:8300" in out
    assert "policy: name=smetric overload=2.0" in out
    assert "a: http=http://127.0.0.1:8000 kv_events=connect tcp://127.0.0.1:5557" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "instance b: no kv_events" in warnings[0]


def test_check_rejects_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, {"hashing": {"block_size": 0}})
    assert main(["controller", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid" in err and "block sizes must be positive" in err
    path = _write(tmp_path, {"policy": {"name": "fastest"}})
    assert main(["controller", "--check", str(path)]) == 2
    assert "policy.name" in capsys.readouterr().err
