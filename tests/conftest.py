import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def _skip_reason(rep: pytest.TestReport) -> str:
    lr = rep.longrepr
    return str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


def _needs_shared(reason: str) -> bool:
    """A skip for want of the shared reference data (traces, recorded frames): every such skip
    names SMETRIC_SHARED or a path under the shared folder."""
    return "SMETRIC_SHARED" in reason or str(shared_dir()) in reason


def _data_skips(skipped: list[pytest.TestReport]) -> list[pytest.TestReport]:
    if shared_dir().is_dir():
        return []
    return [r for r in skipped if _needs_shared(_skip_reason(r))]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say loudly which tests did not run for want of the shared data, and why."""
    data = _data_skips(terminalreporter.stats.get("skipped", []))
    if not data:
        return
    tr = terminalreporter
    tr.write_sep("!", f"{len(data)} test(s) did NOT run: no shared data folder at {shared_dir()}", red=True, bold=True)
    tr.write_line("They need reference data the repository may not carry (real traces, recorded engine frames). "
                  "Put the shared folder beside the clone (../shared) or set SMETRIC_SHARED to it. Not run:",
                  yellow=True)
    for r in data:
        tr.write_line(f"  {r.nodeid}: {_skip_reason(r)}", yellow=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """On CI (CI=true) everything the tests need is installed, so a skipped test is a failure —
    except one that needs the shared data where no shared folder exists (said loudly above);
    where the folder exists, every skip fails."""
    if os.environ.get("CI") != "true" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    data = _data_skips(skipped)
    other = [r for r in skipped if r not in data]
    if other:
        reporter.ensure_newline()
        reporter.write_line(f"CI=true: {len(other)} test(s) skipped; CI installs everything, so that fails the run",
                            red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
