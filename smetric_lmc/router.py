"""One routing step: index lookup -> cluster view -> policy -> load accounting.

The controller and the simulator both route through this class, so what is simulated is what runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from smetric_lmc.config import PolicyConfig
from smetric_lmc.index import Lookup, TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.policy import ClusterView, Policy, make_policy
from smetric_lmc.wire import Reason


@dataclass(slots=True)
class Routed:
    instance_id: str | None
    reason: Reason
    policy: str
    local_hit_tokens: int  # on the chosen instance
    best_local_hit_tokens: int  # anywhere: the cache-loss funnel compares the two
    global_hit_tokens: int
    est_hit_tokens: int
    turn: int
    prompt_tokens: int
    load: float  # chosen instance's load before this request


class Router:
    def __init__(
        self,
        index: TierIndex,
        load: LoadTracker,
        policy: PolicyConfig | None = None,
        *,
        disaggregated: bool = False,
    ) -> None:
        self.index = index
        self.load = load
        self.disaggregated = disaggregated
        self._rr = 0
        self.set_policy(policy or PolicyConfig())

    def set_policy(self, cfg: PolicyConfig) -> None:
        self.policy_cfg = cfg
        self._policy: Policy = make_policy(cfg)

    def route(
        self,
        request_id: str,
        blocks: Sequence[int],
        chunks: Sequence[int] | None,
        prompt_tokens: int,
        *,
        turn: int | None = None,
        est_hit: int | None = None,
        candidates: Sequence[str] | None = None,
    ) -> Routed:
        """Decide where ``request_id`` goes and count it in flight there."""
        found = self.index.lookup(blocks, chunks)
        routed = self.decide(request_id, found, prompt_tokens, turn=turn, est_hit=est_hit, candidates=candidates)
        if routed.instance_id is not None and blocks:
            # A follow-up can arrive before this prompt's KV events: credit it there meanwhile.
            self.index.add_pending(routed.instance_id, blocks)
        return routed

    def decide(
        self,
        request_id: str,
        found: Lookup,
        prompt_tokens: int,
        *,
        turn: int | None = None,
        est_hit: int | None = None,
        candidates: Sequence[str] | None = None,
    ) -> Routed:
        bs = self.index.block_size
        est = (est_hit or 0) // bs * bs
        if turn is None:  # unknown: a request that carries cached-worthy history is a follow-up
            turn = 1 if est > 0 else 0
        order = self.index.instances
        local = found.local_hit_tokens()
        if candidates is None:
            ids: Sequence[str] = order
            hits = local
        else:
            pos = {iid: k for k, iid in enumerate(order)}
            ids = [c for c in candidates if c in pos]
            hits = [local[pos[c]] for c in ids]
        loads = self.load.loads(ids, self.disaggregated)
        unpre = [float(self.load.unprefilled(i)) for i in ids] if self.policy_cfg.name == "dynamo" else None
        view = ClusterView(
            instances=ids,
            local_hit=hits,
            load=loads,
            prompt_tokens=prompt_tokens,
            turn=turn,
            est_hit=est,
            global_hit=found.global_hit_tokens,
            unprefilled=unpre,
            rr=self._rr,
        )
        self._rr += 1
        d = self._policy(view)
        best = max(hits, default=0)
        if d.index < 0:
            return Routed(None, d.reason, self.policy_cfg.name, 0, best, found.global_hit_tokens, est, turn,
                          prompt_tokens, 0.0)
        chosen = ids[d.index]
        self.load.on_route(request_id, chosen, prompt_tokens, max(hits[d.index], found.global_hit_tokens))
        return Routed(chosen, d.reason, self.policy_cfg.name, hits[d.index], best, found.global_hit_tokens, est,
                      turn, prompt_tokens, loads[d.index])
