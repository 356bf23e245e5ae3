"""Locate (optionally create) the venv holding LMCache 0.5.6's controller code.

LMCache cannot live in the project's own environment (it pins torch and many heavy packages), so
wire-compatibility checks run LMCache's real classes in a subprocess of the engine venv made by
``.ci/engine-venv.sh`` (vLLM CPU + ``lmcache==0.5.6 --no-deps``). Tests call :func:`lmcache_python`
and skip when it returns None. Set ``SMETRIC_LMCACHE_VENV_CREATE=1`` to let the first test create
a missing venv (slow).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "engine-venv.sh"
STAMP = ".smetric-extras-stamp"  # written by engine-venv.sh once lmcache is installed


def venv_dir() -> Path:
    env = os.environ.get("SMETRIC_LMCACHE_VENV") or os.environ.get("SMETRIC_ENGINE_VENV")
    return Path(env) if env else Path.home() / ".cache" / "smetric" / "vllm-venv"


def lmcache_python() -> Path | None:
    """The venv's interpreter if the venv is complete (stamp present), else None."""
    d = venv_dir()
    py = d / "bin" / "python"
    if py.exists() and (d / STAMP).exists():
        return py
    if os.environ.get("SMETRIC_LMCACHE_VENV_CREATE") == "1" and SCRIPT.exists():
        subprocess.run(["bash", str(SCRIPT)], check=False, timeout=1800, stdout=sys.stderr)
        if py.exists() and (d / STAMP).exists():
            return py
    return None


def require_lmcache_python() -> Path:
    py = lmcache_python()
    if py is None:
        pytest.skip(
            f"LMCache venv not found at {venv_dir()}: run `bash .ci/engine-venv.sh` "
            "(or set SMETRIC_LMCACHE_VENV / SMETRIC_LMCACHE_VENV_CREATE=1)"
        )
    return py


def run_in_lmcache_venv(code: str, *, stdin: bytes = b"", timeout: float = 60.0) -> bytes:
    """Run ``code`` with the venv's Python; return stdout, fail the test with stderr on error."""
    py = require_lmcache_python()
    proc = subprocess.run(
        [str(py), "-c", code], input=stdin, capture_output=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"LMCache subprocess failed ({proc.returncode}):\n{proc.stderr.decode()[-4000:]}")
    return proc.stdout
