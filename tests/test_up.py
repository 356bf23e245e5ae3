"""``smetric up`` without its vLLM engines: the banner and the port check before start-up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from smetric_lmc.cli import build_parser
from smetric_lmc.workers import launch, supervise, up


def _stack(tmp_path: Path) -> up.LocalStack:
    engines = [SimpleNamespace(instance_id=f"vllm-{i}", http_url=f"http://127.0.0.1:{8000 + i}", model="tiny",
                               process=SimpleNamespace(log_path=tmp_path / f"vllm-{i}.log")) for i in range(2)]
    procs = [launch.ProcessGroup(["true"], {}, tmp_path / f"{n}.log", n) for n in ("controller", "gateway")]
    return up.LocalStack(engines, tmp_path / "smetric.yaml", "http://127.0.0.1:8080",  # type: ignore[arg-type]
                         "http://127.0.0.1:9600/metrics", procs, route_url="tcp://127.0.0.1:5600", policy="smetric")


def test_banner_names_every_url_and_every_log(tmp_path: Path) -> None:
    text = up.banner(_stack(tmp_path))
    for needle in ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/metrics", "http://127.0.0.1:9600/metrics",
                   "http://127.0.0.1:9600/healthz", "tcp://127.0.0.1:5600", str(tmp_path / "smetric.yaml"),
                   str(tmp_path / "vllm-0.log"), str(tmp_path / "vllm-1.log"), str(tmp_path / "controller.log"),
                   str(tmp_path / "gateway.log"), "X-SMetric-Index-Ready: false", "policy smetric"):
        assert needle in text, needle


def test_fixed_default_ports_and_a_taken_one_fails_before_engines_start() -> None:
    args = build_parser(["up"]).parse_args(["up"])
    assert (args.port, args.metrics_port, args.route_port) == (8080, 9600, 5600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"metrics port {taken}"):
            up.check_ports("127.0.0.1", {"gateway": 0, "metrics": taken, "route": 0})
    up.check_ports("127.0.0.1", {"gateway": 0, "metrics": taken, "route": 0})  # free again


def _sleeper(tmp_path: Path, name: str, seconds: float) -> launch.ProcessGroup:
    return launch.ProcessGroup([sys.executable, "-c", f"import time; time.sleep({seconds})"], dict(os.environ),
                               tmp_path / f"{name}.log", name)


def test_supervisor_restarts_an_exited_part_with_backoff_and_leaves_the_rest(tmp_path: Path) -> None:
    dies, stays = _sleeper(tmp_path, "engine", 0.1), _sleeper(tmp_path, "gateway", 60)
    dies.start()
    stays.start()
    swapped: list[launch.ProcessGroup] = []
    sup = supervise.Supervisor([supervise.Part(dies, swapped.append), supervise.Part(stays)], backoff_s=0.2,
                               max_backoff_s=0.4)
    try:
        times = []
        t0 = time.monotonic()
        while len(times) < 3 and time.monotonic() - t0 < 10:
            if sup.check():
                times.append(time.monotonic())
            time.sleep(0.02)
        assert len(times) == 3 and sup.parts[0].restarts == 3
        assert swapped and swapped[-1] is sup.parts[0].proc and swapped[0] is not dies
        # Backoff doubles, capped: ~0.1 s run + 0.2, then + 0.4, then + 0.4 again.
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(g >= 0.45 for g in gaps), gaps
        assert sup.parts[1].proc is stays and stays.poll() is None and sup.parts[1].restarts == 0
    finally:
        for p in sup.parts:
            p.proc.stop(timeout_s=2)


_RUN_UP = """
import signal, sys, time
from pathlib import Path
from types import SimpleNamespace
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell leaves a background job
from smetric_lmc.workers import launch, up
tmp = Path(sys.argv[1])
child = launch.ProcessGroup(["sh", "-c", "sleep 60 & sleep 60"], {}, tmp / "child.log", "child")
def bring_up(args, workdir):
    child.start()
    print(child.pid, flush=True)
    return up.LocalStack([], tmp / "smetric.yaml", "http://x", "http://y/metrics", [child])
up.bring_up = bring_up
up.banner = lambda stack: "banner"
sys.exit(up.run_up(SimpleNamespace(workdir=str(tmp), host="127.0.0.1", port=0, metrics_port=0, route_port=0)))
"""


_RUN_UP_SIGNAL_IN_POLL = _RUN_UP.replace("up.banner = ", """
class Sup:  # Popen.poll's window: its wait lock taken, its try/finally not yet entered
    def check(self):
        child.proc._waitpid_lock.acquire(False)
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))  # a few bytecodes for the handler to run between
        child.proc._waitpid_lock.release()
        return []
import os
up.supervisor = lambda stack: Sup()
up.banner = """)


def test_a_signal_landing_inside_a_poll_still_stops_the_stack(tmp_path: Path) -> None:
    """A handler that raised there left the lock held and the stop waited on it forever."""
    proc = subprocess.Popen([sys.executable, "-c", _RUN_UP_SIGNAL_IN_POLL, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, SMETRIC_STATE_DIR=str(tmp_path / "state")))
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        assert proc.wait(timeout=20) == 0
        assert up.group_members(pgid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sigint_and_sigterm_stop_everything_even_in_the_background(tmp_path: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _RUN_UP, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, SMETRIC_STATE_DIR=str(tmp_path / "state")))
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "banner"
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        assert up.group_members(pgid) == []  # the child's whole group is gone, grandchildren too
    finally:
        if proc.poll() is None:
            proc.kill()
