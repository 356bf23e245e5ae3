"""Start real redis-server / mooncake_master processes on free loopback ports for tests.

Usage from a test module (``tests/`` is on ``sys.path`` under pytest's default import mode)::

    from services import RedisServer, require_redis
    with RedisServer() as srv:
        ... srv.url ...

Each helper skips the calling test with a clear reason when the binary is
missing (install them with ``.ci/services.sh``).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from smetric_lmc.workers import launch

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_path() -> Path:
    """$SMETRIC_SHARED, else the ``shared`` folder beside the repository."""
    return Path(os.environ.get("SMETRIC_SHARED", REPO_ROOT.parent / "shared"))


def shared_dir() -> Path:
    """The shared reference data (fixtures, traces); skips the test if absent."""
    path = shared_path()
    if not path.is_dir():
        pytest.skip(f"shared reference data not found at {path} (set SMETRIC_SHARED)")
    return path


def fixture_path(name: str) -> Path:
    path = shared_dir() / "fixtures" / name
    if not path.is_file():
        pytest.skip(f"fixture {path} not found (set SMETRIC_SHARED)")
    return path


def free_port() -> int:
    return launch.free_ports(1)[0]


def wait_port(port: int, timeout_s: float, proc: launch.ProcessGroup | None = None) -> None:
    launch.wait_port("127.0.0.1", port, proc, timeout_s)


def _stop(process: launch.ProcessGroup | None) -> None:
    if process is not None:
        process.stop(timeout_s=5.0)


def require_redis() -> str:
    try:
        return launch.find_binary("redis-server", "SMETRIC_REDIS_SERVER")
    except launch.GlobalStoreUnavailable:
        pytest.skip("redis-server not installed (run .ci/services.sh)")


class RedisServer:
    """A throwaway redis-server without persistence on a free 127.0.0.1 port."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.exe = require_redis()
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.process: launch.ProcessGroup | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="smetric-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self._dir.name, "--daemonize", "no", *self.extra_args,
        ]
        log_path = Path(self._dir.name) / "redis.log"
        self.process = launch.ProcessGroup(args, dict(os.environ), log_path, "redis-server")
        self.process.start()
        wait_port(self.port, 10.0, self.process)
        return self

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same port (state is lost: no persistence)."""
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()


def mooncake_master_binary() -> str:
    """The ``mooncake_master`` executable shipped inside the mooncake wheel."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mooncake-transfer-engine-non-cuda not installed (run .ci/services.sh)")
    exe = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not exe.is_file():
        pytest.skip(f"mooncake wheel has no master binary at {exe}")
    if not os.access(exe, os.X_OK):
        exe.chmod(exe.stat().st_mode | 0o111)
    return str(exe)


class MooncakeMaster:
    """A mooncake_master with its HTTP metadata server and admin HTTP on free loopback ports.

    ``events_port`` is passed as ``--kv_events_bind_endpoint``; the PyPI wheel's
    master accepts the flag but was built without KV events, so nothing binds it.
    """

    def __init__(self, *extra_args: str, lease_ms: int = 500) -> None:
        self.exe = mooncake_master_binary()
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.admin_port = free_port()
        self.events_port = free_port()
        self.lease_ms = lease_ms
        self.extra_args = list(extra_args)
        self.process: launch.ProcessGroup | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="smetric-mooncake-")
        self._log_path = Path(self._dir.name) / "master.log"

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-n:])

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        args = [
            self.exe,
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1", "--rpc_thread_num=2",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.admin_port}",
            "--enable_kv_events=true", f"--kv_events_bind_endpoint={self.events_endpoint}",
            f"--default_kv_lease_ttl={self.lease_ms}",
            *self.extra_args,
        ]
        self.process = launch.ProcessGroup(
            args, dict(os.environ), self._log_path, "mooncake_master", cwd=Path(self._dir.name)
        )
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise RuntimeError(f"mooncake_master exited with {rc}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.admin_url}/get_all_keys", timeout=1.0) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"mooncake_master admin HTTP not up after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.1)
        wait_port(self.rpc_port, 5.0, self.process)
        wait_port(self.metadata_port, 5.0, self.process)
        return self

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"{self.admin_url}{path}", timeout=5.0) as resp:
            return int(resp.status), resp.read().decode()

    def stop(self) -> None:
        _stop(self.process)
        self.process = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._dir.cleanup()
