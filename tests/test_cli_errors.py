"""Issue 21 items 4 and 5: a user's mistake gets one clear line and a non-zero exit, never a
traceback; the controller and the gateway find their packaged default config from any folder.

Every command runs as the console script does (``python -m smetric_lmc.cli``), as a child process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
import zmq

from smetric_lmc.workers import launch


def _smetric(*argv: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smetric_lmc.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def _one_clean_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "Traceback" not in text, text
    assert needle in text, text


def test_gateway_on_a_taken_port_says_so_without_claiming_to_listen() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        out = _smetric("gateway", "--port", str(s.getsockname()[1]), timeout=30)
    _one_clean_error(out, "cannot listen on 127.0.0.1:")
    assert "listening on" not in out.stderr and "smetric down" in out.stderr


def test_controller_on_a_taken_route_port_says_so(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    cfg = {"model": "tiny", "instances": [{"id": "a", "http": "http://127.0.0.1:9"}],
           "server": {"route_url": f"tcp://127.0.0.1:{port}", "metrics_port": 0}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    try:
        out = _smetric("controller", "--config", str(tmp_path / "c.yaml"), timeout=30)
    finally:
        sock.close(0)
        ctx.term()
    _one_clean_error(out, "controller: cannot start")
    assert len([ln for ln in out.stderr.splitlines() if " ERROR " in ln]) == 1, out.stderr


def test_sim_with_a_missing_trace(tmp_path: Path) -> None:
    _one_clean_error(_smetric("sim", "--trace", "missing.json", cwd=tmp_path), "missing.json")


def test_sim_with_an_unknown_profile_lists_the_profiles() -> None:
    out = _smetric("sim", "--profile", "h100")
    _one_clean_error(out, "no hardware profile 'h100'")
    assert "qwen3-30b-a3b-h20" in out.stderr


def test_replay_with_a_wrong_url_fails_fast() -> None:
    port = launch.free_ports(1)[0]  # nothing listens there
    t0 = time.monotonic()
    out = _smetric("replay", "--url", f"http://127.0.0.1:{port}", "--sessions", "40", "--rate", "5", "--quiet",
                   timeout=60)
    assert time.monotonic() - t0 < 30
    _one_clean_error(out, f"cannot reach http://127.0.0.1:{port}")
    assert out.returncode == 1


def _mock_engine(tmp_path: Path, speed: str) -> tuple[subprocess.Popen[bytes], str]:
    ready = tmp_path / "ready.json"
    engine = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "mock-engine", "--speed", speed,
                               "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert engine.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return engine, json.loads(ready.read_text())["instances"][0]["http_url"]


def test_replay_ctrl_c_prints_what_was_measured(tmp_path: Path) -> None:
    """Against a real mock engine (the simulator's engine model, slowed so the replay is still
    running when interrupted)."""
    engine, url = _mock_engine(tmp_path, "20")
    try:
        rec = tmp_path / "r.jsonl"
        proc = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "replay", "--url", url, "--sessions", "8",
                                 "--rate", "20", "--time-scale", "0.001", "--context-scale", "0.05", "--quiet",
                                 "--records", str(rec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (rec.exists() and len(rec.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "replay finished or stalled before Ctrl-C"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        engine.terminate()
        engine.wait(10)
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    assert proc.returncode == 130
    assert "interrupted:" in stdout and "requests measured so far" in stdout
    assert "| policy | TPS in SLO (tok/s) |" in stdout  # the summary of what was measured


def test_gateway_and_controller_without_config_work_outside_the_repository(tmp_path: Path) -> None:
    port = launch.free_ports(1)[0]
    gw = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "gateway", "--port", str(port)], cwd=tmp_path,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert gw.poll() is None and time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.2)
    finally:
        gw.send_signal(signal.SIGTERM)
        _, err = gw.communicate(timeout=20)
    assert "cannot read" not in err and "using the packaged example" in err, err[-2000:]

    route = launch.free_ports(1)[0]
    ctl = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "controller", "--route-url",
                            f"tcp://127.0.0.1:{route}"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 30
        # Up once the route port answers, or exited (the example's metrics port 9600 may be taken here:
        # then it says so in one line, after reading the config).
        while ctl.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", route), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
    finally:
        if ctl.poll() is None:
            ctl.send_signal(signal.SIGTERM)
        _, err = ctl.communicate(timeout=20)
    assert "cannot read" not in err and "bad config" not in err, err[-2000:]
    assert "using the packaged example" in err and "Traceback" not in err, err[-2000:]
