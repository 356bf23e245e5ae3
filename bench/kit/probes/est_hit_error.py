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

    python bench/decide.py --probe est_hit_error [--conversations 100] [--calibrate 20] [--seed 0]

Needs the engine venv ($SMETRIC_ENGINE_VENV, default ~/.cache/smetric/vllm-venv). Prints a table,
then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from kit.token_estimate import conversations, errors, exact_counts, summary
from smetric_lmc.session import ChatTokenEstimator


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
