"""One routing step: index lookup -> cluster view -> policy -> load accounting.

The controller and the simulator both route through this class, so what is simulated is what runs.

A request without a turn (a ``/v1/completions`` prompt, a client that does not count turns) is a
follow-up when it says how much history it carries (``est_hit > 0``); otherwise the index decides:
when the prompt's longest local hit runs past the depth other instances also hold (the shared
prefix: system prompt, tool definitions), that extra part is a session's own history, so the
request is a follow-up expecting that hit; else it is a first turn. ``turn_source`` on the
decision says which case applied, and the controller counts each.
"""

from __future__ import annotations

from collections.abc import Sequence

from smetric_lmc.config import PolicyConfig
from smetric_lmc.index import Lookup, TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.policy import ClusterView, Policy, make_policy
from smetric_lmc.policy.view import DenseHits, DenseLoads, Hits, Loads
from smetric_lmc.prices import PriceFeed
from smetric_lmc.wire import RouteDecision, TurnSource


class Router:
    def __init__(
        self,
        index: TierIndex,
        load: LoadTracker,
        policy: PolicyConfig | None = None,
        *,
        disaggregated: bool = False,
        rotation: list[int] | None = None,
    ) -> None:
        self.index = index
        self.load = load
        self.disaggregated = disaggregated
        # Round-robin pointers (see ClusterView.rr), one for first turns and one for follow-ups:
        # a follow-up's pick never moves the pointer first turns rotate by (rr_argmin in the paper).
        # Routers answering for one cluster in turn (the controller's load-balance fallback while
        # its index fills) share them, so a switch does not restart the rotation.
        self.rotation = rotation if rotation is not None else [0, 0]
        # learns each instance's prices from done reports (the owner feeds it: controller, simulator);
        # a policy that declares needs={"prices"} decides with them
        self.prices: PriceFeed | None = None
        self.set_policy(policy or PolicyConfig())

    @property
    def policy(self) -> Policy:
        return self._policy

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
    ) -> RouteDecision:
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
    ) -> RouteDecision:
        bs = self.index.block_size
        est = (est_hit or 0) // bs * bs
        order = self.index.instances
        hits: Hits
        if candidates is None:
            ids: Sequence[str] = order
            hits = found
        else:
            pos = {iid: k for k, iid in enumerate(order)}
            ids = [c for c in candidates if c in pos]
            hits = DenseHits([found.at(pos[c]) for c in ids])
        source = TurnSource.REQUEST
        if turn is None:
            turn, est, source = _infer_turn(hits, len(ids), est)
        loads: Loads
        if candidates is None and not self.disaggregated:
            # live, O(1) per question: read what the decision needs before on_route changes it
            loads = self.load.aligned(order, (id(self.index), self.index.membership))
        else:
            loads = DenseLoads(self.load.loads(ids, self.disaggregated))
        policy = self._policy
        unpre = [float(self.load.unprefilled(i)) for i in ids] if "unprefilled" in policy.needs else None
        infl = [float(self.load.in_flight(i)) for i in ids] if "in_flight" in policy.needs else None
        kind = 0 if turn == 0 else 1
        feed = self.prices
        book = feed.book if feed is not None and "prices" in policy.needs else None
        view = ClusterView(ids, None, None, prompt_tokens, turn, est, found.global_hit_tokens, unpre, infl,
                           self.rotation[kind], hits=hits, loads=loads,
                           prices=[book.decision_prices(i) for i in ids] if book is not None else None)
        c = policy(view)
        self.rotation[kind] = c.index + 1
        best = view.best_hit()[0]
        if c.index < 0:
            return RouteDecision(request_id, None, None, c.reason, policy.name, 0, found.global_hit_tokens, est, turn,
                                 prompt_tokens, 0.0, best, source)
        chosen = ids[c.index]
        hit = hits.at(c.index)
        load = loads.at(c.index)
        if feed is not None:
            # the queue it joins, read before on_route adds this request to it
            feed.on_routed(request_id, chosen, prompt_tokens, hit, found.global_hit_tokens,
                           float(self.load.unprefilled(chosen)), float(self.load.in_flight(chosen)))
        self.load.on_route(request_id, chosen, prompt_tokens, max(hit, found.global_hit_tokens))
        return RouteDecision(request_id, chosen, None, c.reason, policy.name, hit, found.global_hit_tokens,
                             est, turn, prompt_tokens, load, best, source)


def _infer_turn(hits: Hits, n: int, est: int) -> tuple[int, int, TurnSource]:
    """(turn, est_hit, source) for a request that carried no turn (see the module docstring)."""
    if est > 0:
        return 1, est, TurnSource.EST_HIT
    best, holders = hits.best()
    # a follow-up when one instance alone holds the longest hit
    if best > 0 and (n if holders is None else len(holders)) == 1:
        return 1, best, TurnSource.INDEX_FOLLOW_UP
    return 0, 0, TurnSource.INDEX_FIRST_TURN
