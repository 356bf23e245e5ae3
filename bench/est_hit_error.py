"""Error of the gateway's est_hit estimate (``ChatTokenEstimator``) against a real tokenizer and chat
template, on held-out conversations.

The reference is the tiny local model's tokenizer (byte-level BPE trained on the top-level modules
of the Python standard library, ChatML template; ``workers/tinymodel.py``) run in the engine venv
through ``transformers``' ``apply_chat_template``, exactly what the engine does with a request. The
conversations are built from text that tokenizer never saw: prose from the installed packages'
metadata and code from the standard library's sub-packages, with tool schemas and tool calls mixed
in. The estimator is measured as it starts (no calibration) and after observing the exact counts of
the first ``--calibrate`` conversations, as the gateway does with each request an engine tokenizes;
both are evaluated on the remaining (held-out) conversations only.

    python bench/est_hit_error.py [--conversations 100] [--calibrate 20] [--seed 0]

Needs the engine venv ($SMETRIC_ENGINE_VENV, default ~/.cache/smetric/vllm-venv). Prints a table,
then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import subprocess
import sys
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--calibrate", type=int, default=20, help="conversations whose exact counts are observed first")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    convs = conversations(args.conversations, args.seed)
    truth = exact_counts(convs)
    train, test = convs[: args.calibrate], convs[args.calibrate :]
    t_train, t_test = truth[: args.calibrate], truth[args.calibrate :]
    fresh = ChatTokenEstimator()
    calibrated = ChatTokenEstimator()
    for c, t in zip(train, t_train):
        calibrated.observe(c["history"], c["tools"], t)
    rows = {"uncalibrated": summary(errors(fresh, test, t_test)),
            "calibrated": summary(errors(calibrated, test, t_test))}
    print(f"{len(test)} held-out conversations, history {min(t_test)}..{max(t_test)} tokens "
          f"(median {int(statistics.median(t_test))}); calibrated on {len(train)}: "
          f"{calibrated.bytes_per_token:.2f} bytes/token (starts at {fresh.bytes_per_token:.2f})")
    print(f"{'estimator':<14}{'mean |err|':>12}{'p50 |err|':>11}{'p90 |err|':>11}{'max |err|':>11}{'bias':>9}")
    for name, r in rows.items():
        print(f"{name:<14}{r['mean_abs']:>11.1%}{r['p50_abs']:>11.1%}{r['p90_abs']:>11.1%}"
              f"{r['max_abs']:>11.1%}{r['bias']:>+9.1%}")
    print(json.dumps({"held_out": len(test), "calibrated_on": len(train),
                      "bytes_per_token": round(calibrated.bytes_per_token, 3),
                      **{f"{k}_{m}": round(v, 4) for k, r in rows.items() for m, v in r.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
