"""Synthetic agentic workload calibrated to the WEKA Claude Code trace (see fit.py).

A root session is an agent loop: a shared framework prompt (system prompt + tool definitions, the
same for every session of one agent type), a first user turn, then calls that each append the
previous output and tool results to the context. Occasionally the agent drops its history (context
compaction) and starts a new context on the same framework prompt, or spawns a sub-agent, which is
its own session with its own framework prompt. Arrivals are open-loop times as a recorded trace
would have them: previous arrival + previous service time + think time.

All distributions are lognormal (parameters of the underlying normal), fitted on the real trace.
Block ids are splitmix64 hashes of (context stream, block position): equal ids exactly when the
prefix is the same, like chained hashes, but computed vectorised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import xxhash

from smetric_lmc.lab.workload.model import BLOCK_DTYPE, TraceRequest, TraceSession, Workload


@dataclass(frozen=True, slots=True)
class LogNormal:
    mu: float
    sigma: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(self.mu, self.sigma, n)

    @property
    def median(self) -> float:
        return float(np.exp(self.mu))


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Shape of one agent type's sessions (the main agent, or a sub-agent type)."""

    prompt_tokens: int  # shared framework prompt: system prompt + tool definitions
    calls: LogNormal  # requests per session
    max_calls: int
    first_extra: LogNormal  # first turn's tokens beyond the framework prompt


@dataclass(frozen=True, slots=True)
class SyntheticParams:
    block_size: int
    main: AgentParams
    subagent: AgentParams
    subagent_types: dict[str, float]  # sub-agent type -> probability
    subagent_rate: float  # sub-agents spawned per main-agent call
    growth: LogNormal  # context growth of a call that carries the previous one's history
    p_no_growth: float  # share of carried calls whose context does not grow (trimmed tool output)
    p_reset: float  # share of non-first calls that drop history and start a new context
    reset_extra: LogNormal  # a restarted context's tokens beyond the framework prompt
    max_context: int  # context size at which the agent compacts (resets)
    output: LogNormal
    max_output: int
    p_zero_think: float
    think: LogNormal  # client seconds before a follow-up, when not zero
    # service time of a call: exp(a) * out^b * in^c seconds (log-linear fit on the trace)
    service: tuple[float, float, float]
    kinds: dict[str, float] = field(default_factory=lambda: {"n": 1.0})
    # token counts are multiplied by `scale` (shorter contexts for tests), shape kept
    scale: float = 1.0
    # Agent frameworks of root sessions -> share of sessions. Each framework has its own prompt ids
    # (shared by all its sessions); "main" alone is the WEKA fit (one framework, Claude Code).
    frameworks: dict[str, float] = field(default_factory=lambda: {"main": 1.0})
    # Forked agents: a fork is a new session (parent_id = the root) whose first request carries the
    # root's whole current context plus its own task (`fork.first_extra`), spawned at `fork_rate` per
    # root call. The paper counts their reuse of the parent's context as inter-session.
    fork: AgentParams | None = None
    fork_rate: float = 0.0
    # Context limit of the agent (it compacts above it), in scaled tokens; None: max_context x scale.
    # Presets replayed on a model with a shorter window clip it there, as a real agent would.
    context_limit: int | None = None
    label: str = "weka"  # the preset these parameters come from (names the workload)
    # Per-user prompt variants: only the first `prompt_shared_tokens` (unscaled) of a framework prompt
    # are the same for every session of that framework; the rest (environment, memory files, tool
    # list as rendered after them) is the same only for the sessions of one user, about
    # `sessions_per_user` root sessions each. None: the whole framework prompt is shared (the WEKA fit).
    prompt_shared_tokens: int | None = None
    sessions_per_user: float = 1.0

    def scaled(self, scale: float) -> SyntheticParams:
        return dataclasses.replace(self, scale=scale)

    def limited(self, context_limit: int | None) -> SyntheticParams:
        return dataclasses.replace(self, context_limit=context_limit)


# Fitted on the WEKA Claude Code trace (639 conversations) by `python -m smetric_lmc.lab.workload.fit`;
# the fit's output is in docs/workload.md.
WEKA_FIT = SyntheticParams(
    block_size=64,
    main=AgentParams(
        prompt_tokens=14944,
        calls=LogNormal(3.7842, 0.9735),
        max_calls=439,
        first_extra=LogNormal(8.9229, 2.7293),
    ),
    subagent=AgentParams(
        prompt_tokens=8684,
        calls=LogNormal(2.3026, 0.4499),
        max_calls=24,
        first_extra=LogNormal(7.1639, 0.7364),
    ),
    subagent_types={"Explore": 0.868, "general-purpose": 0.113, "Plan": 0.019},
    subagent_rate=0.00124,
    growth=LogNormal(5.9054, 1.6953),
    p_no_growth=0.1044,
    p_reset=0.0173,
    reset_extra=LogNormal(11.1895, 0.8567),
    max_context=582771,
    output=LogNormal(5.3799, 1.1021),
    max_output=18195,
    p_zero_think=0.0054,
    think=LogNormal(2.3026, 2.2199),
    service=(-4.1945, 0.6917, 0.1992),
    kinds={"n": 0.8185, "s": 0.1815},
)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _stream_ids(key: np.uint64, n: int) -> np.ndarray:
    return _splitmix(np.arange(n, dtype=BLOCK_DTYPE) * _GOLDEN ^ key)


class _Gen:
    def __init__(self, seed: int, p: SyntheticParams) -> None:
        self.rng = np.random.default_rng(seed)
        self.p = p
        self.seed = seed
        self.n_streams = 0
        self.shared: dict[str, np.ndarray] = {}
        self.kind_names = list(p.kinds)
        self.kind_p = np.array([p.kinds[k] for k in self.kind_names], dtype=float)
        self.kind_p /= self.kind_p.sum()
        self.user = -1  # the current root session's user (per-user prompt variants), -1: none

    def tokens(self, x: np.ndarray | float) -> np.ndarray:
        return np.maximum(1, np.rint(np.asarray(x, dtype=float) * self.p.scale)).astype(np.int64)

    def _key(self, tag: str) -> np.uint64:
        # Streams of different seeds never share ids, so generated workloads can be mixed.
        return np.uint64(xxhash.xxh3_64_intdigest(f"{self.seed}:{tag}".encode()))

    def _shared_ids(self, agent: str, n: int) -> np.ndarray:
        ids = self.shared.get(agent)
        if ids is None or len(ids) < n:
            ids = _stream_ids(np.uint64(hash_agent(agent)), max(n, 1))
            self.shared[agent] = ids
        return ids[:n]

    def session(
        self,
        sid: str,
        agent: str,
        ap: AgentParams,
        parent: str | None,
        offset: float,
        out: list[TraceSession],
        inherit: np.ndarray | None = None,
        turn0: int = 0,
    ) -> None:
        """One session; `inherit` (a fork): block ids of the parent context it starts from, and
        `turn0` the turn of its first request (a fork's messages carry the parent's assistant turns)."""
        p, rng, bs = self.p, self.rng, self.p.block_size
        n = int(np.clip(np.rint(ap.calls.sample(rng, 1)[0]), 1, ap.max_calls))
        framework_prompt = int(self.tokens(ap.prompt_tokens))
        prompt = framework_prompt if inherit is None else len(inherit) * bs
        first = int(self.tokens(ap.first_extra.sample(rng, 1))[0])
        growth = self.tokens(p.growth.sample(rng, n))
        growth[rng.random(n) < p.p_no_growth] = 0
        reset = rng.random(n) < p.p_reset
        reset_extra = self.tokens(p.reset_extra.sample(rng, n))
        outs = np.minimum(self.tokens(p.output.sample(rng, n)), max(1, int(p.max_output * p.scale)))
        thinks = np.where(rng.random(n) < p.p_zero_think, 0.0, p.think.sample(rng, n))
        kinds = rng.choice(len(self.kind_names), size=n, p=self.kind_p)
        limit = p.context_limit if p.context_limit is not None else int(p.max_context * p.scale)
        max_ctx = max(framework_prompt + bs, limit)

        inputs = np.empty(n, dtype=np.int64)
        turns = np.empty(n, dtype=np.int64)
        stream_of = np.empty(n, dtype=np.int64)
        ctx, turn, stream = prompt + first, turn0, 0
        for i in range(n):
            if i:
                grown = ctx + int(outs[i - 1]) + int(growth[i])
                if reset[i] or grown > max_ctx:
                    ctx, turn, stream = framework_prompt + int(reset_extra[i]), 0, stream + 1
                else:
                    ctx, turn = grown, turn + 1
            inputs[i] = min(ctx, max_ctx)
            turns[i] = turn
            stream_of[i] = stream
        a, b, c = p.service
        # service time is fitted on full-size tokens; scaling tokens must not shrink the timeline
        service = np.exp(a) * (outs / p.scale) ** b * (inputs / p.scale) ** c
        arrivals = np.concatenate([[0.0], np.cumsum(service[:-1] + thinks[1:])])
        thinks[0] = 0.0

        nblocks = inputs // bs
        prompt_blocks = framework_prompt // bs
        blocks: list[np.ndarray] = [np.empty(0, dtype=BLOCK_DTYPE)] * n
        for s in range(stream + 1):
            idx = np.flatnonzero(stream_of == s)
            longest = int(nblocks[idx].max())
            ids = _stream_ids(self._key(f"{sid}#{s}"), longest)
            if s == 0 and inherit is not None:
                k = min(len(inherit), longest)
                ids[:k] = inherit[:k]
            else:
                k = min(prompt_blocks, longest)
                ids[:k] = self._shared_ids(agent, k)
                if p.prompt_shared_tokens is not None and self.user >= 0:
                    # past the shared head, the prompt is this user's variant of the framework's
                    head = min(k, int(self.tokens(p.prompt_shared_tokens)) // bs)
                    ids[head:k] = _stream_ids(np.uint64(hash_agent(f"{agent}@user{self.user}")), k)[head:k]
            for i in idx:
                blocks[i] = ids[: nblocks[i]]

        reqs = [
            TraceRequest(
                float(arrivals[i]),
                int(inputs[i]),
                int(outs[i]),
                blocks[i],
                float(thinks[i]),
                self.kind_names[kinds[i]],
                int(turns[i]),
            )
            for i in range(n)
        ]
        out.append(TraceSession(sid, reqs, parent, offset))
        if parent is None and p.fork is not None and p.fork_rate > 0:
            for k, i in enumerate(np.flatnonzero(rng.random(n) < p.fork_rate)):
                # the fork starts from the context of call i once that call returns
                self.session(f"{sid}/fork_{k:03d}", agent, p.fork, sid, offset + float(arrivals[i] + service[i]),
                             out, inherit=blocks[i], turn0=int(turns[i]) + 1)  # fmt: skip
        if parent is None and p.subagent_rate > 0:
            spawn = np.flatnonzero(rng.random(n) < p.subagent_rate)
            types = list(p.subagent_types)
            probs = np.array([p.subagent_types[t] for t in types], dtype=float)
            for k, i in enumerate(spawn):
                st = types[int(rng.choice(len(types), p=probs / probs.sum()))]
                # the sub-agent runs as a tool call of request i: it starts when that call returns
                self.session(
                    f"{sid}/agent_{k:03d}", st, p.subagent, sid, offset + float(arrivals[i] + service[i]), out
                )


def hash_agent(agent: str) -> int:
    return xxhash.xxh3_64_intdigest(("synthetic-framework-prompt:" + agent).encode())


def synthetic(
    n_sessions: int, *, seed: int, params: SyntheticParams = WEKA_FIT, scale: float | None = None
) -> Workload:
    """Generate `n_sessions` root agent sessions (plus their sub-agents), deterministic in `seed`.

    `scale` (or `params.scale`) multiplies all token counts, e.g. 0.1 for short test contexts.
    Root sessions all start at 0, as in the WEKA trace: a replay places them (e.g. Poisson).
    """
    p = params if scale is None else params.scaled(scale)
    gen = _Gen(seed, p)
    sessions: list[TraceSession] = []
    names = list(p.frameworks)
    probs = np.array([p.frameworks[k] for k in names], dtype=float)
    users = max(1, round(n_sessions / p.sessions_per_user))
    for i in range(n_sessions):
        # one framework (the WEKA fit) draws nothing, so its workloads stay what they were
        fw = names[int(gen.rng.choice(len(names), p=probs / probs.sum()))] if len(names) > 1 else names[0]
        if p.prompt_shared_tokens is not None:
            gen.user = int(gen.rng.integers(users))
        gen.session(f"syn{i:05d}", fw, p.main, None, 0.0, sessions)
    meta = {
        "source": "synthetic",
        "format": "synthetic",
        "preset": p.label,
        "seed": seed,
        "scale": p.scale,
        "absolute_starts": False,
        "shared_prefix": True,
        "notes": [
            f"synthetic agent sessions, preset {p.label} (scale {p.scale:g})",
            "framework prompt blocks shared by all sessions of one agent type",
            "no absolute session start times: root sessions start at 0 and a replay places them",
        ],
    }
    name = f"synthetic-s{seed}" if p.label == "weka" else f"{p.label}-s{seed}"
    return Workload(name, p.block_size, sessions, meta)
