"""Fit `SyntheticParams` to a loaded WEKA trace and print them as Python for synthetic.py.

python -m smetric_lmc.lab.workload.fit PATH_TO_WEKA_ARCHIVE
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path

import numpy as np

from smetric_lmc.lab.workload.model import TraceSession, Workload
from smetric_lmc.lab.workload.synthetic import AgentParams, LogNormal, SyntheticParams
from smetric_lmc.lab.workload.weka import load_weka

log = logging.getLogger(__name__)

Z90 = 1.2815515655446004  # standard normal 90th percentile


def fit_lognormal(x: np.ndarray | list[float]) -> LogNormal:
    """Lognormal matching the median and the 90th percentile of the positive values.

    Quantile matching rather than log-moments: the traces' tails are lighter than lognormal in the
    logs' lower half (many tiny values), and the body (p50..p90) is what shapes the load.
    """
    a = np.asarray(x, dtype=float)
    a = a[a > 0]
    if len(a) == 0:
        return LogNormal(0.0, 0.0)
    p50, p90 = np.percentile(a, [50, 90])
    sigma = max(0.0, float(np.log(p90 / p50)) / Z90)
    return LogNormal(round(float(np.log(p50)), 4), round(sigma, 4))


def _agent(sessions: list[TraceSession], prompt: dict[str, int]) -> AgentParams:
    calls = [len(s.requests) for s in sessions]
    p = [prompt.get(s.session_id, 0) for s in sessions]
    first = [s.requests[0].input_tokens - prompt.get(s.session_id, 0) for s in sessions]
    return AgentParams(
        prompt_tokens=int(np.median(p)) if p else 0,
        calls=fit_lognormal(calls),
        max_calls=int(max(calls)) if calls else 1,
        first_extra=fit_lognormal(first),
    )


def fit_weka(w: Workload) -> SyntheticParams:
    prompt: dict[str, int] = w.meta.get("prompt_tokens", {})
    agent_types: dict[str, str] = w.meta.get("agent_types", {})
    roots = [s for s in w.sessions if s.parent_id is None]
    subs = [s for s in w.sessions if s.parent_id is not None]
    growth, reset_extra, outs, thinks, log_service = [], [], [], [], []
    n_follow = n_reset = n_carried = n_flat = n_zero_think = 0
    kinds: collections.Counter[str] = collections.Counter()
    for s in w.sessions:
        sp = prompt.get(s.session_id, 0)
        rs = s.requests
        for i, r in enumerate(rs):
            outs.append(r.output_tokens)
            kinds[r.kind] += 1
            if i == 0:
                continue
            prev = rs[i - 1]
            n_follow += 1
            if r.turn == 0:
                n_reset += 1
                reset_extra.append(r.input_tokens - sp)
            else:
                n_carried += 1
                # growth beyond the previous output: tool results and the user's new turn
                g = r.input_tokens - prev.input_tokens - prev.output_tokens
                if g <= 0:
                    n_flat += 1
                else:
                    growth.append(g)
            if r.think_time <= 0:
                n_zero_think += 1
            else:
                thinks.append(r.think_time)
            service = r.arrival - prev.arrival - r.think_time
            if service > 0 and prev.output_tokens > 0 and prev.input_tokens > 0:
                log_service.append((np.log(service), np.log(prev.output_tokens), np.log(prev.input_tokens)))
    ls = np.array(log_service)
    design = np.column_stack([np.ones(len(ls)), ls[:, 1], ls[:, 2]])
    coef, *_ = np.linalg.lstsq(design, ls[:, 0], rcond=None)
    sub_types = collections.Counter(agent_types.get(s.session_id, "subagent") for s in subs)
    total_kinds = sum(kinds.values())
    root_calls = sum(len(s.requests) for s in roots)
    inputs = [r.input_tokens for _, r in w.iter_requests()]
    return SyntheticParams(
        block_size=w.block_size,
        main=_agent(roots, prompt),
        subagent=_agent(subs, prompt),
        subagent_types={k: round(v / len(subs), 3) for k, v in sub_types.most_common()} if subs else {},
        subagent_rate=round(len(subs) / max(1, root_calls), 5),
        growth=fit_lognormal(growth),
        p_no_growth=round(n_flat / max(1, n_carried), 4),
        p_reset=round(n_reset / max(1, n_follow), 4),
        reset_extra=fit_lognormal(reset_extra),
        # the agent compacts near its context limit: the largest contexts seen, minus outliers
        max_context=int(np.percentile(inputs, 99.5)),
        output=fit_lognormal(outs),
        max_output=int(max(outs)),
        p_zero_think=round(n_zero_think / max(1, n_follow), 4),
        think=fit_lognormal(thinks),
        service=tuple(round(float(c), 4) for c in coef),  # type: ignore[arg-type]
        kinds={k: round(v / total_kinds, 4) for k, v in kinds.most_common()},
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path, help="WEKA archive, folder or conversation file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    w = load_weka(args.path)
    print(f"WEKA_FIT = {fit_weka(w)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
