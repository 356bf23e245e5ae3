"""``smetric sim calibrate``: measure a running vLLM engine and write a simulator profile.

Timed requests on an otherwise idle engine (token-id prompts, ``ignore_eos``, streaming):

* prefill: first-token time of fresh prompts of several lengths, and of new tokens after a cached
  context (the context sent once before, so the engine's prefix cache holds it);
* decode: time per output token for batches of concurrent requests at two context lengths;
* KV capacity and block size from ``vllm:cache_config_info`` on ``/metrics``; the request length
  limit from ``/v1/models``; the scheduler's limits (``max_num_seqs``, ``max_num_batched_tokens``,
  chunked prefill) from the engine's startup log when given, else vLLM's defaults for its OpenAI
  server on a CPU (no endpoint reports them).

The profile's iteration model is ``max(flops / F, bytes / B) + overhead``. Prefill times fit the
effective compute rate F (and an intercept: per-request API/scheduling time the engine adds before
the first iteration); decode step times fit the overhead and the effective memory bandwidth B. The
model's shape (layers, heads, parameters) comes from its ``config.json`` when ``--model-dir`` is
given, else from the base profile; only the ratios matter, since F and B are fitted to them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from smetric_lmc.lab.replay.compare import with_kv_tokens, write_profile
from smetric_lmc.lab.sim.profile import Profile, load_profile

log = logging.getLogger(__name__)


@dataclass
class Sample:
    kind: str  # "prefill" | "decode"
    new_tokens: int  # prefill: tokens computed; decode: requests in the batch
    context: int  # prefill: cached tokens before them; decode: sum of contexts in the batch
    seconds: float


@dataclass
class Calibration:
    profile: Profile
    samples: list[Sample]
    api_overhead_s: float
    residuals: dict[str, list[float]] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    at_bound: list[str] = field(default_factory=list)  # fitted parameters clamped to FIT_BOUNDS

    def report(self) -> str:
        p = self.profile
        lines = [
            f"engine: {self.engine}",
            f"fit: compute {p.peak_flops * p.compute_eff:.3g} FLOP/s, memory {p.hbm_bw * p.mem_eff:.3g} B/s, "
            f"iteration overhead {p.iter_overhead_s * 1e3:.2f} ms, first-token API overhead "
            f"{self.api_overhead_s * 1e3:.2f} ms; KV {p.kv_capacity_tokens()} tokens",
        ]
        for kind, res in self.residuals.items():
            r = np.asarray(res)
            lines.append(f"{kind} residuals (measured/model - 1): median {np.median(r):+.1%}, "
                         f"max |.| {np.max(np.abs(r)):.1%} over {len(r)} points")
        for name in self.at_bound:
            lines.append(f"WARNING: {name} hit its bound {FIT_BOUNDS[name]}: the probes do not determine it")
        return "\n".join(lines)


def model_shape(model_dir: Path) -> dict[str, Any]:
    """Profile fields from a Hugging Face ``config.json`` (dense decoder)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    q = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads", q))
    hd = int(cfg.get("head_dim") or h // q)
    inter = int(cfg.get("intermediate_size", 4 * h))
    vocab = int(cfg.get("vocab_size", 0))
    per_layer = h * (q * hd) + 2 * h * (kv * hd) + (q * hd) * h + 3 * h * inter
    params = layers * per_layer + 2 * vocab * h
    dtype = str(cfg.get("torch_dtype", "float32"))
    width = 4.0 if "32" in dtype else 2.0
    return {"total_params": float(params), "active_params": float(params), "layers": layers, "q_heads": q,
            "kv_heads": kv, "head_dim": hd, "bytes_per_param": width, "kv_bytes_per_elem": width}


async def _engine_info(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    info: dict[str, Any] = {}
    async with http.get(f"{url}/v1/models") as r:
        card = (await r.json())["data"][0]
        info["model"] = card["id"]
        info["max_model_len"] = int(card.get("max_model_len") or 0)
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:cache_config_info":
            labels = fam.samples[0].labels
            info["num_gpu_blocks"] = int(labels["num_gpu_blocks"])
            info["block_size"] = int(labels["block_size"])
    if "num_gpu_blocks" not in info:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info: cannot read the KV capacity")
    return info


# vLLM 0.32's defaults for its OpenAI server on a CPU (``EngineArgs.get_batch_defaults``); chunked
# prefill is on there. A GPU engine's depend on the card: give its log or the values.
VLLM_CPU_SERVER_DEFAULTS: dict[str, Any] = {"max_num_seqs": 128, "max_num_batched_tokens": 2048,
                                            "enable_chunked_prefill": True}


def scheduler_limits(log_text: str | None) -> dict[str, Any]:
    """The scheduler limits a vLLM engine runs with: what its startup log says (``non-default args``
    for the two limits, the config line for chunked prefill), vLLM's CPU defaults for the rest."""
    out = dict(VLLM_CPU_SERVER_DEFAULTS, source="vLLM CPU defaults")
    if not log_text:
        return out
    args = re.search(r"non-default args: (.*)", log_text)
    found = []
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        m = re.search(rf"'{key}': (\d+)", args.group(1)) if args else None
        if m:
            out[key] = int(m.group(1))
            found.append(key)
    m = re.search(r"enable_chunked_prefill=(True|False)", log_text)
    if m:
        out["enable_chunked_prefill"] = m.group(1) == "True"
        found.append("enable_chunked_prefill")
    if args or m:
        out["source"] = "engine log" + (f" ({', '.join(found)}; defaults for the rest)" if found else " (defaults)")
    return out


class _Prober:
    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, vocab: int, seed: int) -> None:
        self.http, self.url, self.model = http, url, model
        self.rng = random.Random(seed)
        self.vocab = vocab

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    async def timed(self, prompt: list[int], max_tokens: int) -> Timing:
        """One streamed request, timed from the send."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        t0 = time.perf_counter()
        out = Timing()
        async with self.http.post(f"{self.url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"calibration request failed: HTTP {r.status}: {(await r.text())[:300]}")
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                now = time.perf_counter() - t0
                choice = obj["choices"][0] if obj.get("choices") else None
                if choice is not None and choice.get("text") is not None:
                    # A chunk carries every token the server had when it wrote it: when the API
                    # server falls behind the engine, several (its token_ids say how many).
                    n = len(choice["token_ids"]) if choice.get("token_ids") is not None else 1
                    if out.first != out.first:
                        out.first = now
                        n -= 1
                    if n > 0:
                        out.later.append((now, n))
                if obj.get("usage"):
                    out.cached = int((obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        out.end = time.perf_counter() - t0
        return out


@dataclass
class Timing:
    first: float = float("nan")  # first token, seconds after the send
    later: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of later chunks
    end: float = float("nan")  # the stream closed
    cached: int = 0

    def step_after(self, start: float) -> float | None:
        """Mean decode step from ``start`` to the last token: chunk gaps would mislead when the
        server coalesces tokens (a gap of microseconds inside a burst)."""
        n = sum(k for t, k in self.later if t > start)
        last = max((t for t, _ in self.later), default=start)
        return (last - start) / n if n and last > start else None


async def measure(url: str, *, vocab: int = 4096, repeats: int = 3, seed: int = 0,
                  decode_batches: tuple[int, ...] = (1, 2, 4, 8), decode_tokens: int = 32) -> tuple[dict, list[Sample]]:
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        info = await _engine_info(http, url)
        pr = _Prober(http, url, info["model"], vocab, seed)
        limit = info["max_model_len"] - decode_tokens - 8
        bs = info["block_size"]
        samples: list[Sample] = []
        await pr.timed(pr.tokens(64), 2)  # first request pays one-off warm-up costs
        sizes = [n for n in (32, 128, 256, 512, 1024, 1536) if n <= limit]
        for n in sizes:
            for _ in range(repeats):
                tm = await pr.timed(pr.tokens(n), 1)
                samples.append(Sample("prefill", n - tm.cached, tm.cached, tm.first))
        for ctx in (c for c in (256, 768) if c + 256 <= limit):
            for n in (64, 256):
                for _ in range(repeats):
                    base = pr.tokens(ctx)
                    await pr.timed(base, 1)  # now cached (whole blocks of it)
                    tm = await pr.timed(base + pr.tokens(n), 1)
                    samples.append(Sample("prefill", ctx + n - tm.cached, tm.cached, tm.first))
        for ctx in (64, min(768, limit)):
            for b in decode_batches:
                res = await asyncio.gather(*(pr.timed(pr.tokens(ctx), decode_tokens) for _ in range(b)))
                # Steps while all b decode together: after the slowest first token.
                start = max(r.first for r in res)
                steps = [x for x in (r.step_after(start) for r in res) if x is not None]
                if steps:
                    samples.append(Sample("decode", b, b * (ctx + decode_tokens // 2), statistics.median(steps)))
        info["block_size"] = bs
        return info, samples


def robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Theil-Sen line (median of pairwise slopes): on a shared machine a few first tokens wait
    hundreds of ms for a CPU, and a least-squares line follows them (negative intercepts, a
    compute rate off by 4x between runs); the median ignores them."""
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    if not keep.any():
        return 0.0, float(np.median(y))
    slope = float(np.median((y[j] - y[i])[keep] / dx[keep]))
    return slope, float(np.median(y - slope * x))


# What a fit may return (compute FLOP/s, memory B/s, iteration overhead s): a parameter the probes do
# not determine (a tiny model's decode steps are all overhead, so their time does not grow with the
# bytes read) would otherwise run off to a meaningless value (a memory bandwidth of 1e18 B/s). The
# range spans a laptop CPU to the fastest accelerators; a value at a bound is clamped and reported.
FIT_BOUNDS: dict[str, tuple[float, float]] = {"compute": (1e8, 1e16), "memory": (1e9, 2e13),
                                              "overhead": (1e-5, 1.0)}


def _bounded(name: str, value: float, hit: list[str]) -> float:
    lo, hi = FIT_BOUNDS[name]
    if not np.isfinite(value) or value < lo or value > hi:
        hit.append(name)
        return float(hi if not np.isfinite(value) or value > hi else lo)
    return float(value)


def fit(base: Profile, info: dict[str, Any], samples: list[Sample], *, max_num_seqs: int,
        max_num_batched_tokens: int, name: str) -> Calibration:
    """Least-squares fit of the profile's iteration model to the samples."""
    p0 = base.with_overrides(compute_eff=1.0, mem_eff=1.0, tp=1, tp_eff=1.0, local_cpu_gib=0.0)
    pre = [s for s in samples if s.kind == "prefill"]
    dec = [s for s in samples if s.kind == "decode"]
    if len(pre) < 3 or len(dec) < 2:
        raise RuntimeError("too few samples to fit")
    flops = np.array([p0.flops_per_token * s.new_tokens + p0.attn_flops_per_pair * (
        s.new_tokens * s.context + s.new_tokens * (s.new_tokens + 1) // 2) for s in pre])
    t = np.array([s.seconds for s in pre])
    slope, intercept = robust_line(flops, t)
    hit: list[str] = []
    peak = _bounded("compute", 1.0 / slope if slope > 0 else float("inf"), hit)
    mem = np.array([p0.weight_bytes_read + p0.kv_bytes_per_token * (s.context + s.new_tokens) for s in dec])
    comp = np.array([p0.flops_per_token * s.new_tokens + p0.attn_flops_per_pair * s.context for s in dec]) / peak
    td = np.array([s.seconds for s in dec])
    # Decode steps are memory-bound unless the batch is large: fit o + mem/B on the steps the fit
    # itself says are memory-bound, and the overhead alone from compute-bound ones if none are.
    mask = np.ones(len(dec), dtype=bool)
    m_slope, overhead = 0.0, float(np.median(td - comp))
    for _ in range(3):
        if mask.sum() < 2 or np.ptp(mem[mask]) == 0:
            break
        m_slope, overhead = (float(v) for v in np.polyfit(mem[mask], td[mask], 1))
        if m_slope <= 0:
            m_slope, overhead = 0.0, float(np.median(td - comp))
            break
        mask = mem * m_slope >= comp
    overhead = _bounded("overhead", overhead, hit)
    bw = _bounded("memory", 1.0 / m_slope if m_slope > 0 else float("inf"), hit)
    api = max(0.0, float(intercept) - overhead)
    prof = p0.with_overrides(
        name=name, peak_flops=float(peak), hbm_bw=float(bw), iter_overhead_s=overhead,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=int(info["max_model_len"]) or p0.max_model_len)
    prof = with_kv_tokens(prof, info["num_gpu_blocks"] * info["block_size"]).with_overrides(name=name)
    res_pre = [(s.seconds - api) / prof.iteration_time([(s.new_tokens, s.context)], 0, 0) - 1 for s in pre]
    res_dec = [s.seconds / prof.iteration_time([], s.new_tokens, s.context) - 1 for s in dec]
    cal = Calibration(prof, samples, api, {"prefill": res_pre, "decode": res_dec}, info, hit)
    if hit:
        log.warning("calibration fit: %s at its bound (%s); the probes do not determine it. %s", ", ".join(hit),
                    ", ".join(f"{n} {FIT_BOUNDS[n]}" for n in hit), cal.report())
    return cal


def calibrate(url: str, out: Path, *, base: str | Path | None = None, model_dir: Path | None = None,
              max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
              engine_log: Path | None = None, vocab: int = 4096) -> Calibration:
    """Measure the engine at ``url`` and write the fitted profile to ``out``. Scheduler limits:
    the explicit values, else the engine's log (``engine_log``), else vLLM's CPU defaults."""
    base_prof = load_profile(base) if base else load_profile()
    if model_dir is not None:
        base_prof = base_prof.with_overrides(**model_shape(model_dir))
    sched = scheduler_limits(engine_log.read_text(errors="replace") if engine_log is not None else None)
    if max_num_seqs is not None:
        sched.update(max_num_seqs=max_num_seqs, source=f"{sched['source']}; max_num_seqs given")
    if max_num_batched_tokens is not None:
        sched.update(max_num_batched_tokens=max_num_batched_tokens,
                     source=f"{sched['source']}; max_num_batched_tokens given")
    info, samples = asyncio.run(measure(url, vocab=vocab))
    budget = int(sched["max_num_batched_tokens"])
    if not sched["enable_chunked_prefill"]:
        # vLLM then schedules a whole prompt in one step: the budget is at least the longest prompt.
        budget = max(budget, int(info["max_model_len"]))
        log.warning("%s runs without chunked prefill: the profile's per-step token budget is %d", url, budget)
    info["scheduler"] = sched
    cal = fit(base_prof, info, samples, max_num_seqs=int(sched["max_num_seqs"]), max_num_batched_tokens=budget,
              name=f"calibrated-{info['model']}")
    write_profile(cal.profile, out)
    (out.with_suffix(".samples.json")).write_text(json.dumps([asdict(s) for s in samples]))
    return cal
