"""The `smetric` console script: every part registers its subcommand."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smetric_lmc.cli import main


def test_help_lists_every_part(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("sim", "trace", "controller", "gateway", "up"):
        assert name in out
    assert "unavailable" not in out


def test_trace_synth_then_analyze(tmp_path, capsys):
    path = tmp_path / "w.msgpack"
    assert main(["trace", "synth", "--sessions", "5", "--seed", "1", "--out", str(path)]) == 0
    assert path.exists()
    assert main(["trace", "analyze", str(path), "--instances", "4"]) == 0
    assert "reuse" in capsys.readouterr().out.lower()


def test_controller_rejects_a_bad_config_with_its_key_path(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("policy:\n  overload: lots\n")
    proc = subprocess.run([sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "policy.overload" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("allocator", ["malloc", "pymalloc"])
def test_controller_restarts_itself_under_the_configured_allocator(tmp_path, allocator):
    from services import free_port

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"server:\n  route_url: tcp://127.0.0.1:{free_port()}\n  metrics_port: {free_port()}\n"
                   f"advanced:\n  allocator: {allocator}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    proc = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "controller", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if "controller: allocator" in line or not line:
                break
        assert f"controller: allocator {allocator}" in "".join(seen), "".join(seen)
        # Same pid after the restart: whoever supervises the controller keeps its handle.
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert (b"PYTHONMALLOC=malloc" in environ) == (allocator == "malloc")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
