"""Held-out conversations and their exact token counts (the tiny model's tokenizer and chat
template, run in the engine venv), for measuring the gateway's ``ChatTokenEstimator``:
``bench/decide.py --probe est_hit_error`` and ``tests/test_session.py``. What the conversations are made of:
``bench/kit/probes/est_hit_error.py``'s docstring."""

from __future__ import annotations

import importlib.metadata
import json
import random
import statistics
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from smetric_lmc.session import ChatTokenEstimator, history_of
from smetric_lmc.workers import launch

COUNT_IN_ENGINE_VENV = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for conv in json.load(sys.stdin):
    ids = tok.apply_chat_template(conv["history"], tools=conv["tools"] or None, tokenize=True,
                                  add_generation_prompt=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    out.append(len(ids))
print(json.dumps(out))
"""


def prose_paragraphs() -> list[str]:
    """English paragraphs from installed packages' long descriptions (not the tokenizer's corpus)."""
    paras: list[str] = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        text = dist.read_text("METADATA") or ""
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        for p in body.split("\n\n"):
            p = " ".join(p.split())
            if 120 <= len(p) <= 1500 and sum(c.isalpha() for c in p) > 0.6 * len(p):
                paras.append(p)
    return paras


def code_snippets() -> list[str]:
    """Code from the standard library's sub-packages (the tokenizer trained on top-level modules only)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2] or "site-packages" in str(path):
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for k in range(0, len(lines) - 40, 120):
            out.append("\n".join(lines[k : k + 12 + (k % 29)]))
    return out


TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prose, code = prose_paragraphs(), code_snippets()
    if len(prose) < 50 or len(code) < 50:
        raise SystemExit(f"too little held-out text here (prose {len(prose)}, code {len(code)})")
    convs = []
    for c in range(n):
        tools = [TOOL] if c % 3 == 0 else []
        msgs: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(prose)}]
        for t in range(rng.randint(1, 6)):
            msgs.append({"role": "user", "content": rng.choice(prose if rng.random() < 0.6 else code)})
            if tools and rng.random() < 0.5:
                call = {"id": f"call_{c}_{t}", "type": "function",
                        "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/m{t}.py"})}}
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": rng.choice(code)})
            msgs.append({"role": "assistant", "content": rng.choice(code if rng.random() < 0.5 else prose)})
        msgs.append({"role": "user", "content": rng.choice(prose)})
        convs.append({"history": history_of(msgs), "tools": tools})
    return convs


def exact_counts(convs: list[dict[str, Any]]) -> list[int]:
    py = launch.engine_python()
    if not py.exists():
        raise SystemExit(f"engine venv not found at {py.parent.parent} (set SMETRIC_ENGINE_VENV)")
    model = launch.build_tiny_model(launch.engine_venv_dir().parent / "models" / "tiny-qwen2", python=py)
    proc = subprocess.run([str(py), "-c", COUNT_IN_ENGINE_VENV, str(model)], input=json.dumps(convs),
                          capture_output=True, text=True, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0:
        raise SystemExit(f"tokenizer run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def errors(est: ChatTokenEstimator, convs: list[dict[str, Any]], truth: list[int]) -> list[float]:
    return [(est.count(c["history"], c["tools"]) - t) / t for c, t in zip(convs, truth)]


def summary(errs: list[float]) -> dict[str, float]:
    abs_e = sorted(abs(e) for e in errs)
    return {
        "mean_abs": statistics.fmean(abs_e),
        "p50_abs": abs_e[len(abs_e) // 2],
        "p90_abs": abs_e[int(0.9 * (len(abs_e) - 1))],
        "max_abs": abs_e[-1],
        "bias": statistics.fmean(errs),
    }
