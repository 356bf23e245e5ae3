"""Issue 21 item 3: `smetric up` can be stopped and started again, whatever happened to it.

- the port pre-check binds as the servers do (SO_REUSEADDR): a stopped stack's TIME-WAIT
  connections do not block a restart; a taken port names `smetric status` / `smetric down`;
- `smetric status` / `smetric down` find a running stack from its state file; `down` ends every
  process it started, also after `kill -9` of `smetric up` (a real mock stack: mock engines,
  controller, gateway as child processes);
- an engine's vLLM KV-event socket file (ipc://.../smetric-kv-*) is removed when it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smetric_lmc.workers import launch, up


def test_free_ports_are_never_ones_an_outgoing_connection_could_take() -> None:
    # CI saw `smetric up --mock` fail: the gateway's port, picked free, was handed to one of the
    # controller's outgoing connections before the gateway bound it. Outgoing connections get
    # ports from the kernel's ephemeral range, so a picked port must lie outside it.
    lo, hi = launch._ephemeral_range()
    ports = launch.free_ports(50)
    assert len(set(ports)) == 50
    assert not [p for p in ports if lo <= p <= hi]
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free indeed
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        conns = [socket.create_connection(held.getsockname()) for _ in range(20)]
        try:
            used = {c.getsockname()[1] for c in conns}
            assert used.isdisjoint(launch.free_ports(200))
        finally:
            for c in conns:
                c.close()


def test_a_port_in_time_wait_does_not_block_a_restart() -> None:
    with socket.socket() as srv:
        # as the gateway (aiohttp), the metrics server and libzmq bind: a TIME-WAIT socket inherits it
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end of the connection enters TIME-WAIT
        cli.recv(1)
        cli.close()
    time.sleep(0.1)  # the client's FIN reaches the server end: TIME-WAIT
    up.check_ports("127.0.0.1", {"gateway": port, "metrics": 0, "route": 0})


def test_a_taken_port_points_at_status_and_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="smetric down"):
            up.check_ports("127.0.0.1", {"gateway": s.getsockname()[1], "metrics": 0, "route": 0})


def _smetric(*argv: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smetric_lmc.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _group_alive(pgid: int) -> bool:
    return bool(up.group_members(pgid))


def test_down_ends_every_part_even_after_kill_9_of_up(tmp_path: Path) -> None:
    env = dict(os.environ, SMETRIC_STATE_DIR=str(tmp_path / "state"))
    env.pop(up.UP_ID_ENV, None)
    port = launch.free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "smetric_lmc.cli", "up", "--mock", "2", "--port", str(port),
                             "--metrics-port", "0", "--route-port", "0", "--workdir", str(tmp_path / "w")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state = tmp_path / "state" / f"up-{port}.json"
    try:
        deadline = time.monotonic() + 90
        while not (state.exists() and "gateway_url" in state.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "smetric up --mock did not come up"
            time.sleep(0.2)
        st = json.loads(state.read_text())
        groups = list(st["groups"].values())
        assert len(groups) == 3 and all(_group_alive(g) for g in groups)  # mock engines, controller, gateway

        status = _smetric("status", env=env)
        assert status.returncode == 0 and "running" in status.stdout and f":{port}" in status.stdout, status.stdout

        # The parts are told of their parent's death (SIGTERM) and exit on their own; a hung part
        # cannot act on it (stopped here, so the signal waits): that one `smetric down` must end.
        hung = st["groups"]["gateway"]
        os.killpg(hung, signal.SIGSTOP)
        proc.kill()  # kill -9: no chance to stop its children
        proc.wait(timeout=10)
        others = [g for g in groups if g != hung]
        deadline = time.monotonic() + 20
        while any(_group_alive(g) for g in others) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_group_alive(g) for g in others), "parts outlived their SIGKILLed parent"
        assert _group_alive(hung)  # an orphan now, holding the gateway port
        orphaned = _smetric("status", env=env)
        assert "outlived smetric up" in orphaned.stdout, orphaned.stdout

        down = _smetric("down", env=env)
        assert down.returncode == 0, down.stderr
        assert "leftover process group" in down.stdout, down.stdout
        assert not any(_group_alive(g) for g in groups)
        assert not state.exists()
        assert _smetric("status", env=env).returncode == 3
        up.check_ports("127.0.0.1", {"gateway": port, "metrics": 0, "route": 0})  # free again at once
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for g in json.loads(state.read_text()).get("groups", {}).values() if state.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(g, signal.SIGKILL)


def test_an_engines_kv_event_socket_file_is_removed_when_it_stops(tmp_path: Path) -> None:
    spec = launch.InstanceSpec("vllm-0", "model", http_port=1, kv_events_port=launch.free_ports(1)[0], replay_port=2)
    proc = launch.EngineProcess.from_spec(spec, tmp_path)
    assert proc.ipc_path is not None and proc.ipc_path.name.startswith("smetric-kv-")
    proc.argv = [sys.executable, "-c", "import time; time.sleep(60)"]  # stands in for vLLM: no engine needed
    proc.start()
    proc.ipc_path.touch()  # what vLLM's bound ipc:// PUB leaves behind
    proc.stop(timeout_s=5)
    assert not proc.ipc_path.exists()


def test_engine_start_up_reports_progress_against_the_total(caplog: pytest.LogCaptureFixture) -> None:
    from concurrent.futures import ThreadPoolExecutor

    caplog.set_level("INFO", logger="smetric_lmc.workers.launch")
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(time.sleep, s) for s in (0.05, 0.3, 0.6)]
        launch._report_progress(futures, ["vllm-0", "vllm-1", "vllm-2"], every_s=0.2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engines: ")]
    assert lines[0].startswith("engines: 1/3 healthy") and "waiting for vllm-1, vllm-2" in lines[0]
    assert lines[-1].startswith("engines: 3/3 healthy") and "waiting" not in lines[-1]
