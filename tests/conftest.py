import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("SMETRIC_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared() -> Path:
    d = shared_dir()
    if not d.is_dir():
        pytest.skip(f"shared data folder not found at {d} (set SMETRIC_SHARED)")
    return d


@pytest.fixture(scope="session")
def vllm_fixture(shared: Path) -> dict:
    p = shared / "fixtures" / "vllm_kv_events.json"
    if not p.exists():
        pytest.skip(f"{p} missing")
    return json.loads(p.read_text())
