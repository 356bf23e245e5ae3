"""The `smetric` console script: every part registers its subcommand."""

import subprocess
import sys

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
