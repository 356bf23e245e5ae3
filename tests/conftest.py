import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.asyncio
from gateway_helpers import make_stack  # noqa: F401  (the gateway tests' stack fixture)

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


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    """A ZMQ asyncio context for one test, destroyed (no linger) after it."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On CI (CI=true) everything the tests need is installed, so a skipped test is a failure."""
    if os.environ.get("CI") != "true" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reporter.ensure_newline()
        reporter.write_line(f"CI=true: {len(skipped)} test(s) skipped; CI installs everything, so that fails the run",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
