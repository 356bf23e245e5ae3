"""Calibration: the fit recovers a known profile from its own timings, and a live calibration of a
mock engine reads the engine's KV capacity and length limit and yields a profile the simulator runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from smetric_lmc.lab.mock_engine.cli import options, running_mocks
from smetric_lmc.lab.replay.calibrate import FIT_BOUNDS, Sample, fit, measure
from smetric_lmc.lab.replay.compare import with_kv_tokens
from smetric_lmc.lab.sim.profile import load_profile


def test_fit_recovers_the_profile_that_made_the_timings() -> None:
    true = load_profile().with_overrides(compute_eff=1.0, mem_eff=1.0, iter_overhead_s=0.004, peak_flops=5e13,
                                         hbm_bw=2e12)
    api = 0.010
    samples = [Sample("prefill", n, c, true.iteration_time([(n, c)], 0, 0) + api)
               for n in (64, 256, 1024, 4096) for c in (0, 2048)]
    samples += [Sample("decode", b, b * ctx, true.iteration_time([], b, b * ctx))
                for b in (1, 4, 16, 64) for ctx in (512, 8192)]
    info = {"model": "m", "max_model_len": 16384, "num_gpu_blocks": 1000, "block_size": 32}
    cal = fit(load_profile(), info, samples, max_num_seqs=64, max_num_batched_tokens=4096, name="fitted")
    p = cal.profile
    assert p.instance_flops == pytest.approx(5e13, rel=0.02)
    assert p.iter_overhead_s == pytest.approx(0.004, rel=0.05)
    assert cal.api_overhead_s == pytest.approx(api, rel=0.05)
    assert p.gpu_capacity_blocks(32) == pytest.approx(1000, abs=1)
    assert p.max_model_len == 16384 and p.max_num_seqs == 64
    assert max(abs(r) for r in cal.residuals["prefill"]) < 0.02


def test_a_parameter_the_probes_do_not_determine_is_clamped_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    """Decode steps that do not grow with the bytes read (a tiny model: all overhead) leave the memory
    bandwidth undetermined; the fit used to return 1e18 B/s. It is now clamped to its bound, named in
    ``at_bound``, in the report and in a warning that carries the residuals."""
    true = load_profile().with_overrides(compute_eff=1.0, mem_eff=1.0, iter_overhead_s=0.004, peak_flops=5e13,
                                         hbm_bw=2e12)
    samples = [Sample("prefill", n, 0, true.iteration_time([(n, 0)], 0, 0)) for n in (64, 256, 1024, 4096)]
    samples += [Sample("decode", b, b * 512, 0.006) for b in (1, 4, 16)]  # flat: no memory term
    info = {"model": "m", "max_model_len": 16384, "num_gpu_blocks": 1000, "block_size": 32}
    with caplog.at_level("WARNING"):
        cal = fit(load_profile(), info, samples, max_num_seqs=64, max_num_batched_tokens=4096, name="flat")
    assert cal.at_bound == ["memory"]
    assert cal.profile.hbm_bw == FIT_BOUNDS["memory"][1]
    assert cal.profile.instance_flops == pytest.approx(5e13, rel=0.02)  # the determined one is untouched
    assert "memory hit its bound" in cal.report()
    assert any("memory at its bound" in r.message and "decode residuals" in r.message for r in caplog.records)
    # A fit inside every bound reports none.
    good = [s for s in samples if s.kind == "prefill"]
    good += [Sample("decode", b, b * c, true.iteration_time([], b, b * c)) for b in (1, 64) for c in (512, 8192)]
    assert fit(load_profile(), info, good, max_num_seqs=64, max_num_batched_tokens=4096, name="ok").at_bound == []


def test_calibrating_a_mock_engine_reads_its_limits(tmp_path: Path) -> None:
    """No timing asserted (the machine is shared): what the engine reports must land in the profile."""
    prof = with_kv_tokens(load_profile(), 64_000)

    async def run() -> tuple[dict, list[Sample]]:
        path = tmp_path / "p.yaml"
        from smetric_lmc.lab.replay.compare import write_profile

        write_profile(prof, path)
        async with running_mocks(options(profile=str(path), speed=4.0, max_model_len=4096)) as mocks:
            return await measure(mocks[0][0].http_url, repeats=1, decode_batches=(1, 4), decode_tokens=8)

    info, samples = asyncio.run(run())
    assert info["num_gpu_blocks"] == prof.gpu_capacity_blocks(32) and info["max_model_len"] == 4096
    assert {s.kind for s in samples} == {"prefill", "decode"}
    assert any(s.context > 0 for s in samples if s.kind == "prefill")  # the cached-context probes hit
    cal = fit(load_profile(), info, samples, max_num_seqs=256, max_num_batched_tokens=8192, name="mock")
    assert cal.profile.gpu_capacity_blocks(32) == pytest.approx(info["num_gpu_blocks"], abs=1)
    assert cal.profile.instance_flops > 0 and cal.profile.iter_overhead_s > 0
