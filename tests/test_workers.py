"""Worker launch descriptions, LMCache worker YAMLs (checked by LMCache 0.5.6's own loader),
engine process-group handling and the global-store launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from smetric_lmc.workers import launch, tinymodel
from smetric_lmc.workers.launch import InstanceSpec, LMCacheSpec, worker_launch

REPO = Path(__file__).resolve().parent.parent
YAMLS = [
    REPO / "configs" / "lmcache" / "worker-mooncake.yaml",
    REPO / "configs" / "lmcache" / "worker-redis.yaml",
]


def cpu_spec(**kw: Any) -> InstanceSpec:
    base: dict[str, Any] = dict(
        instance_id="w0",
        model="/models/tiny",
        http_port=8001,
        kv_events_port=5557,
        replay_port=5558,
        python="/venv/bin/python",
    )
    base.update(kw)
    return InstanceSpec(**base)


def test_cpu_worker_argv_and_env_are_exact() -> None:
    wl = worker_launch(cpu_spec())
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tempfile.gettempdir()}/smetric-kv-5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "topic": "kv",
    }
    assert wl.argv == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8001",
        "--max-model-len",
        "2048",
        "--enable-prefix-caching",
        "--block-size",
        "32",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-events-config",
        json.dumps(events, separators=(",", ":")),
        "--enable-prompt-tokens-details",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]
    assert wl.env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONHASHSEED": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    assert wl.lmcache_yaml is None


def test_overrides_extra_args_and_env() -> None:
    wl = worker_launch(
        cpu_spec(
            num_gpu_blocks=96,
            block_size=64,
            python_hash_seed=None,
            extra_args=("--max-num-seqs", "8"),
            extra_env={"VLLM_CPU_KVCACHE_SPACE": "2", "X": "y"},
        )
    )
    i = wl.argv.index("--num-gpu-blocks-override")
    assert wl.argv[i + 1] == "96"
    assert wl.argv[wl.argv.index("--block-size") + 1] == "64"
    assert wl.argv[-2:] == ["--max-num-seqs", "8"]
    assert "PYTHONHASHSEED" not in wl.env
    assert wl.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and wl.env["X"] == "y"


def gpu_spec(store: launch.StoreKind, tmp_path: Path, **lm: Any) -> InstanceSpec:
    lmspec = LMCacheSpec(
        store=store,
        store_address="10.0.0.5:50051" if store == "mooncake" else "10.0.0.6:6379",
        config_path=str(tmp_path / "w3.yaml"),
        controller_pull_url="10.0.0.1:8300",
        controller_reply_url="10.0.0.1:8400",
        worker_ports=(8600, 8601),
        heartbeat_s=5,
        **lm,
    )
    return cpu_spec(instance_id="w3", device="gpu", lmcache=lmspec)


@pytest.mark.parametrize("store", ["mooncake", "redis"])
def test_gpu_worker_with_lmcache(store: launch.StoreKind, tmp_path: Path) -> None:
    wl = worker_launch(gpu_spec(store, tmp_path))
    # GPU engines keep the model's dtype, context length and CUDA graphs.
    assert "--dtype" not in wl.argv and "--enforce-eager" not in wl.argv
    assert "--max-model-len" not in wl.argv
    assert "VLLM_CPU_KVCACHE_SPACE" not in wl.env
    kv = json.loads(wl.argv[wl.argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert wl.env["LMCACHE_CONFIG_FILE"] == str(tmp_path / "w3.yaml")
    assert wl.env["PYTHONHASHSEED"] == "0"
    assert wl.lmcache_yaml is not None
    cfg = yaml.safe_load(wl.lmcache_yaml)
    assert cfg["lmcache_instance_id"] == "w3"
    assert cfg["enable_controller"] is True
    assert cfg["controller_pull_url"] == "10.0.0.1:8300"
    assert cfg["controller_reply_url"] == "10.0.0.1:8400"
    assert cfg["lmcache_worker_ports"] == [8600, 8601]
    assert cfg["lmcache_worker_heartbeat_time"] == 5
    assert cfg["chunk_size"] == 256
    if store == "mooncake":
        assert cfg["remote_url"] == "mooncakestore://10.0.0.5:50051"
        assert cfg["extra_config"]["master_server_address"] == "10.0.0.5:50051"
    else:
        assert cfg["remote_url"] == "redis://10.0.0.6:6379"
        assert "extra_config" not in cfg


def test_mooncake_extra_config_overrides_template(tmp_path: Path) -> None:
    spec = gpu_spec("mooncake", tmp_path, mooncake={"protocol": "tcp", "metadata_server": "P2PHANDSHAKE"})
    cfg = yaml.safe_load(worker_launch(spec).lmcache_yaml or "")
    assert cfg["extra_config"]["protocol"] == "tcp"
    assert cfg["extra_config"]["metadata_server"] == "P2PHANDSHAKE"
    assert cfg["extra_config"]["global_segment_size"] == 21474836480  # kept from the template


# ---------------------------------------------------------------------------------------------
# LMCache 0.5.6's own config loader, run in the engine venv (the project env has no LMCache).
# ---------------------------------------------------------------------------------------------

LOADER = textwrap.dedent(
    """
    import json, sys, yaml
    from lmcache.v1.config import _CONFIG_DEFINITIONS, load_engine_config_with_overrides
    out = {}
    for path in sys.argv[1:]:
        raw = yaml.safe_load(open(path))
        try:
            cfg = load_engine_config_with_overrides(config_file_path=path)
        except Exception as e:
            out[path] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[path] = {
            "unknown": sorted(set(raw) - set(_CONFIG_DEFINITIONS)),
            "loaded": {k: getattr(cfg, k) for k in _CONFIG_DEFINITIONS if k in raw},
        }
    print("RESULT " + json.dumps(out, default=str))
    """
)


def lmcache_load(paths: list[Path]) -> dict[str, Any]:
    py = launch.engine_python()
    if not py.exists():
        pytest.skip(
            f"engine venv with lmcache 0.5.6 not built at {py.parent.parent} (run .ci/engine-venv.sh)"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    proc = subprocess.run(
        [str(py), "-c", LOADER, *map(str, paths)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.integration
def test_repo_yamls_load_in_lmcache() -> None:
    res = lmcache_load(YAMLS)
    for path in YAMLS:
        r = res[str(path)]
        assert "error" not in r, r
        assert r["unknown"] == []
        loaded = r["loaded"]
        raw = yaml.safe_load(path.read_text())
        assert loaded == raw  # every key parsed to the value written, nothing coerced away
        assert loaded["chunk_size"] == 256 and loaded["enable_controller"] is True
    assert res[str(YAMLS[0])]["loaded"]["remote_url"].startswith("mooncakestore://")
    assert res[str(YAMLS[1])]["loaded"]["remote_url"].startswith("redis://")


@pytest.mark.integration
def test_generated_yamls_load_in_lmcache_and_bad_one_is_rejected(tmp_path: Path) -> None:
    paths = []
    for store in ("mooncake", "redis"):
        wl = worker_launch(gpu_spec(store, tmp_path))  # type: ignore[arg-type]
        p = tmp_path / f"gen-{store}.yaml"
        p.write_text(wl.lmcache_yaml or "")
        paths.append(p)
    # The controller needs worker ports; LMCache itself must refuse a config without them.
    bad = yaml.safe_load(paths[1].read_text())
    del bad["lmcache_worker_ports"]
    bad_path = tmp_path / "bad.yaml"
    bad_path.write_text(yaml.safe_dump(bad))
    res = lmcache_load([*paths, bad_path])
    for p in paths:
        r = res[str(p)]
        assert "error" not in r, r
        assert r["unknown"] == []
        assert r["loaded"]["lmcache_instance_id"] == "w3"
        assert r["loaded"]["lmcache_worker_ports"] == [8600, 8601]
    assert "lmcache_worker_ports is required" in res[str(bad_path)]["error"]


# ---------------------------------------------------------------------------------------------
# Process groups (a small stand-in server replaces vLLM here; tests/e2e runs the real engine)
# ---------------------------------------------------------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys
    port = int(sys.argv[1])
    # A grandchild that ignores SIGTERM, like an engine core slow to exit: the group kill
    # must still take it down.
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_engine_process_waits_for_health_and_kills_the_group(tmp_path: Path) -> None:
    port = launch.free_ports(1)[0]
    pidfile = tmp_path / "child.pid"
    wl = launch.WorkerLaunch(
        argv=[sys.executable, "-c", FAKE_SERVER, str(port), str(pidfile)], env={"A": "1"}, lmcache_yaml=None
    )
    proc = launch.EngineProcess(wl, f"http://127.0.0.1:{port}", tmp_path / "fake.log", name="fake")
    with proc:
        waited = proc.wait_ready(timeout_s=30)
        assert waited < 30 and proc.healthy()
        child = int(pidfile.read_text())
        assert _alive(child)
        assert launch.group_rss_bytes(proc.pid or 0) > 0
    t = time.monotonic()
    deadline = t + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "SIGTERM-ignoring grandchild survived stop()"
    assert proc.poll() is not None


ORPHANING_PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from smetric_lmc.workers import launch
    group = launch.ProcessGroup([sys.executable, "-c", "import time; time.sleep(600)"], {}, Path(sys.argv[1]), "child")
    group.start()
    print(group.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_started_process_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    # A runner killed with SIGKILL gets no chance to stop its children; the kernel tells them instead.
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING_PARENT, str(tmp_path / "child.log")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its SIGKILLed parent"


def test_engine_process_reports_early_exit_with_log_tail(tmp_path: Path) -> None:
    wl = launch.WorkerLaunch(
        argv=[sys.executable, "-c", "import sys; print('boom: no model'); sys.exit(3)"],
        env={},
        lmcache_yaml=None,
    )
    proc = launch.EngineProcess(wl, "http://127.0.0.1:9", tmp_path / "x.log", name="bad")
    proc.start()
    try:
        with pytest.raises(launch.EngineStartError, match="exited with 3(.|\n)*boom: no model"):
            proc.wait_ready(timeout_s=20, poll_s=0.1)
    finally:
        proc.stop()


def test_engine_process_writes_lmcache_yaml_before_start(tmp_path: Path) -> None:
    spec = gpu_spec("redis", tmp_path)
    wl = worker_launch(spec)
    # Run a harmless command in place of vLLM that prints the file LMCache would read.
    fake = launch.WorkerLaunch(
        argv=[sys.executable, "-c", "import os; print(open(os.environ['LMCACHE_CONFIG_FILE']).read())"],
        env=wl.env,
        lmcache_yaml=wl.lmcache_yaml,
    )
    proc = launch.EngineProcess(fake, "http://127.0.0.1:9", tmp_path / "y.log")
    proc.start()
    assert proc.proc is not None and proc.proc.wait(timeout=20) == 0
    proc.stop()
    assert yaml.safe_load((tmp_path / "w3.yaml").read_text())["lmcache_instance_id"] == "w3"
    assert "lmcache_instance_id: w3" in (tmp_path / "y.log").read_text()


def test_cli_dry_run_describes_each_worker(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "smetric_lmc.workers.launch",
            "--model",
            "/m",
            "--instances",
            "2",
            "--http-port",
            "9100",
            "--device",
            "gpu",
            "--lmcache-store",
            "redis",
            "--store-address",
            "127.0.0.1:6390",
            "--engine-python",
            "/v/bin/python",
            "--log-dir",
            str(tmp_path),
            "--dry-run",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    workers = json.loads(out)
    assert [w["instance_id"] for w in workers] == ["engine-0", "engine-1"]
    assert [w["argv"][w["argv"].index("--port") + 1] for w in workers] == ["9100", "9101"]
    cfgs = [yaml.safe_load(w["lmcache_yaml"]) for w in workers]
    assert [c["lmcache_worker_ports"] for c in cfgs] == [[8500], [8501]]
    assert {c["remote_url"] for c in cfgs} == {"redis://127.0.0.1:6390"}
    assert workers[1]["env"]["LMCACHE_CONFIG_FILE"] == str(tmp_path / "engine-1.lmcache.yaml")


def test_cli_dry_run_prints_shell_lines_that_run_as_printed(tmp_path: Path) -> None:
    """The default --dry-run output is shell: run by bash with `python` standing in for the engine's
    interpreter, the LMCache YAML lands where LMCACHE_CONFIG_FILE says and the command gets the argv."""
    out = subprocess.run([sys.executable, "-m", "smetric_lmc.workers.launch", "--model", "/m", "--instances", "2",
                          "--device", "gpu", "--host", "0.0.0.0", "--lmcache-store", "redis", "--engine-python", "echo",
                          "--log-dir", str(tmp_path), "--dry-run"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("# engine-0\n") and "\n# engine-1\n" in out
    assert "tcp://*:5800" in out and "tcp://*:5801" in out  # never the controller's route port 5600
    ran = subprocess.run(["bash", "-c", out], capture_output=True, text=True, timeout=30, check=True).stdout
    assert [line.split()[:2] for line in ran.splitlines()] == [["-m", "vllm.entrypoints.openai.api_server"]] * 2
    assert "--port 8000" in ran and "--port 8001" in ran
    assert yaml.safe_load((tmp_path / "engine-1.lmcache.yaml").read_text())["lmcache_worker_ports"] == [8501]


def test_free_ports_are_distinct() -> None:
    ports = launch.free_ports(30)
    assert len(set(ports)) == 30


# ---------------------------------------------------------------------------------------------
# Global store
# ---------------------------------------------------------------------------------------------


def test_missing_mooncake_master_raises_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SMETRIC_MOONCAKE_MASTER", raising=False)
    with pytest.raises(launch.GlobalStoreUnavailable, match="mooncake_master not found"):
        launch.start_global_store("mooncake", log_dir=tmp_path)


def test_mooncake_argv_adds_event_flags_only_when_asked() -> None:
    plain = launch.mooncake_argv("mm", 50051, 8080, 9003)
    assert not any("kv_events" in a for a in plain)
    ev = launch.mooncake_argv("mm", 50051, 8080, 9003, kv_events_endpoint="tcp://127.0.0.1:5577")
    assert "--enable_kv_events=true" in ev and "--kv_events_bind_endpoint=tcp://127.0.0.1:5577" in ev


@pytest.mark.services
def test_redis_store_starts_with_keyspace_events_and_stops(tmp_path: Path) -> None:
    redis = pytest.importorskip("redis")
    try:
        store = launch.start_global_store("redis", log_dir=tmp_path)
    except launch.GlobalStoreUnavailable as e:
        pytest.skip(str(e))
    with store:
        assert store.remote_url == f"redis://127.0.0.1:{store.port}"
        client = redis.Redis(host=store.host, port=store.port)
        # Redis reorders the flag letters when it reports them.
        assert set(client.config_get("notify-keyspace-events")["notify-keyspace-events"]) == set("KEg$xe")
        assert client.config_get("save")["save"] == ""
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    assert store.process.poll() is not None


def test_tinymodel_stamp_decides_rebuild(tmp_path: Path) -> None:
    out = tmp_path / "m"
    assert not tinymodel.is_built(out)
    out.mkdir()
    (out / tinymodel.STAMP_NAME).write_text(json.dumps(tinymodel.recipe(0, 4096)))
    assert tinymodel.is_built(out, seed=0, vocab_size=4096)
    assert not tinymodel.is_built(out, seed=1, vocab_size=4096)
    # build_tiny_model trusts the stamp and never starts the venv's python for a built model.
    assert launch.build_tiny_model(out, python=tmp_path / "no-such-python") == out


def test_kv_event_sockets_stay_on_loopback() -> None:
    # They carry prompt token ids: a loopback stack never binds them on all interfaces.
    local = launch.kv_events_config(cpu_spec())
    assert local["endpoint"].startswith("ipc://") and "*" not in local["replay_endpoint"]
    assert cpu_spec().kv_events_connect == local["endpoint"]
    remote = cpu_spec(host="10.0.0.5")
    cfg = launch.kv_events_config(remote)
    assert cfg["replay_endpoint"] == "tcp://10.0.0.5:5558" and remote.replay_connect == "tcp://10.0.0.5:5558"
    assert cfg["endpoint"] == "tcp://*:5557" and remote.kv_events_connect == "tcp://10.0.0.5:5557"
