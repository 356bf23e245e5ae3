"""Policy ranking for the real-engine validation: a run order drift cannot line up with, the live
run-to-run noise, and the rule that says when the simulator's ranking agrees with the live one.

The rule (docs/validation.md, "Ranking"): each policy runs ``repeats`` times in a balanced order
(forward, then reversed, ...), so a drift of the machine over the run weighs on every policy alike.
A policy's live (and simulated) throughput is the median over its repeats; its noise is the spread of
its live repeats, (max - min) / median. For every pair of policies, their live throughputs differ by
``live`` (relative to the pair's mean), the simulated ones by ``sim``, and the pair's noise is the
larger of the two policies' noises:

* ``|live| <= noise``: a **tie**, the live order is chance. It passes unless the simulator orders
  the pair strongly the other way (``sim`` of the opposite sign and ``|sim| > noise``): then the
  simulator claims a separation the engines do not show, and the pair is ``tie-contradicted``.
* otherwise the pair is **separated**: ``agree`` when ``sim`` has the same sign, ``disagree`` if not.

``rank_agree`` is true when at least one pair is separated and no pair disagrees or contradicts.
A replay that stalls (another job takes its core for seconds) widens its policy's noise, so that
policy's pairs become ties rather than verdicts on a stall.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def run_order(policies: tuple[str, ...] | list[str], repeats: int) -> list[tuple[str, int]]:
    """(policy, repeat) slots: forward on even repeats, reversed on odd ones (ABC CBA ABC ...). With an
    even number of repeats every policy's mean position in the run is the same, so a drift linear in
    time shifts every policy's mean alike."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    pols = list(policies)
    if len(set(pols)) != len(pols):
        raise ValueError(f"policies repeat: {pols}")
    return [(p, r) for r in range(repeats) for p in (pols if r % 2 == 0 else pols[::-1])]


def spread(values: list[float]) -> float:
    """Run-to-run spread of repeated replays: (max - min) / median; 0 with fewer than two."""
    if len(values) < 2:
        return 0.0
    return float((max(values) - min(values)) / np.median(values))


@dataclass
class PairVerdict:
    a: str
    b: str
    live_rel: float  # (tput a - tput b) / mean of the two, live (medians over repeats)
    sim_rel: float  # the same, simulated
    noise: float  # the pair's noise: the larger spread of the two policies' live repeats
    verdict: str  # "agree", "disagree", "tie" or "tie-contradicted"


def _rel(x: float, y: float) -> float:
    return (x - y) / ((x + y) / 2)


def rank_pairs(rows: list[dict[str, Any]]) -> list[PairVerdict]:
    """Every pair of policies (rows: ``policy``, ``tput_live``, ``tput_sim``, ``noise``, one per
    policy) judged by the rule above. Noise 0 judges plain ordering."""
    out = []
    for i, ra in enumerate(rows):
        for rb in rows[i + 1:]:
            noise = max(ra["noise"], rb["noise"])
            live = _rel(ra["tput_live"], rb["tput_live"])
            sim = _rel(ra["tput_sim"], rb["tput_sim"])
            if abs(live) <= noise:
                verdict = "tie-contradicted" if live * sim < 0 and abs(sim) > noise else "tie"
            else:
                verdict = "agree" if live * sim > 0 else "disagree"
            out.append(PairVerdict(ra["policy"], rb["policy"], live, sim, noise, verdict))
    return out


def rank_fields(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench's ranking fields (see the module's rule)."""
    pairs = rank_pairs(rows)
    separated = [p for p in pairs if p.verdict in ("agree", "disagree")]
    bad = [p for p in pairs if p.verdict in ("disagree", "tie-contradicted")]
    return {"rank_agree": bool(separated) and not bad,
            "rank_noise_rel": {r["policy"]: round(r["noise"], 4) for r in rows},
            "rank_pairs_separated": len(separated),
            "rank_ties": [f"{p.a}~{p.b}" for p in pairs if p.verdict.startswith("tie")],
            "rank_disagreements": [f"{p.a}~{p.b}:{p.verdict}" for p in bad]}


def pairs_table(pairs: list[PairVerdict]) -> str:
    lines = ["throughput differences per pair, medians over the repeats (noise: the larger spread of the two "
             "policies' live repeats)", "| pair | live | sim | noise | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {p.a} vs {p.b} | {p.live_rel:+.1%} | {p.sim_rel:+.1%} | {p.noise:.1%} | {p.verdict} |"
              for p in pairs]
    return "\n".join(lines) + "\n"
