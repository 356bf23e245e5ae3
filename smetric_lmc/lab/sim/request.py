"""Runtime state of one simulated request (shared by the cluster, the engines and the recorder)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from smetric_lmc.lab.sim.cache import Node


class SimRequest:
    """One request from arrival to completion; ``inst`` is the ``Instance`` serving it."""

    __slots__ = (
        "rid", "idx", "session", "turn", "blocks", "n_blocks", "input", "output", "arrival",
        "inst", "reason", "local_blocks", "global_blocks", "local_tokens", "global_tokens", "todo",
        "ctx", "node", "reserved", "admit_hit", "decoded", "first_token", "finish", "prefill_done_at",
        "gpu_total", "sticky", "saved", "gnode", "load_pending", "load_s",
    )  # fmt: skip

    def __init__(
        self, rid: str, idx: int, session: Any, turn: int, blocks: np.ndarray, input_tokens: int,
        output_tokens: int, arrival: float,
    ) -> None:  # fmt: skip
        self.rid = rid
        self.idx = idx
        self.session = session
        self.turn = turn
        self.blocks = blocks
        self.n_blocks = len(blocks)
        self.input = max(1, input_tokens)
        self.output = max(1, output_tokens)
        self.arrival = arrival
        self.inst: Any = None
        self.reason = ""
        self.local_blocks = 0  # prompt blocks the instance held at admission
        self.global_blocks = 0  # blocks after those, fetched from the global tier
        self.local_tokens = 0
        self.global_tokens = 0
        self.todo = 0  # prompt tokens still to compute
        self.ctx = 0  # tokens with KV on the instance
        self.node: Node | None = None  # deepest pinned local cache node
        self.reserved = 0
        self.admit_hit = 0
        self.decoded = 0
        self.first_token = math.nan
        self.finish = math.nan
        self.prefill_done_at = math.nan
        self.gpu_total = 0
        self.sticky = -1  # follow-ups: 1 when served by the session's first-turn instance
        self.saved = 0  # prompt blocks the global tier holds or this request stored there
        self.gnode: Node | None = None  # global-tier node pinned while its blocks are fetched
        self.load_pending = False  # a fetch that the next step must wait for (sync / layerwise)
        self.load_s = 0.0  # time spent fetching from the global tier
