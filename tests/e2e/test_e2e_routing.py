"""SMetric end to end: two real vLLM CPU engines, ``smetric controller`` and ``smetric gateway``.

Everything is real and talks over loopback: the engines (tiny random Qwen2, block size 32, prefix
caching, KV events, ``--enable-prompt-tokens-details``), the controller (subscribed to both
engines' KV events, polling their /metrics every 6.25 s (its poll timeout is 0.8 x that)) and the gateway, both as child processes
started the way ``smetric up`` starts them. Multi-turn chat sessions replay through the gateway.

Checked, in order, on one pair of engines (starting engines is the slow part):
  (a) follow-ups return to their first-turn instance, first turns spread over both engines;
  (b) the controller's predicted local hit equals the engine's ``cached_tokens`` within a block;
  (c) an engine holding a long turn (its core paused, so the turn stays in flight) sheds the
      follow-ups of its other sessions (``overloaded_fallback``);
  (d) after ``/reset_prefix_cache`` a session that lived there rebalances (``evicted_fallback``);
  then the same replay under ``load_balance``: SMetric must have more cached tokens.

OVERLOAD is 1.5 here, not the default 2.0: with two instances ``l[s] <= 2 x mean(l)`` always holds
(``2 x mean = l[s] + l[other]``), so the default can never shed load from a pair of engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smetric_lmc.workers import launch, up

log = logging.getLogger(__name__)

pytestmark = pytest.mark.e2e

BLOCK = 32
# Odd on purpose: with an even count, load_balance's round-robin tie-break would send every
# session back to the same instance each round and look sticky by accident.
N_SESSIONS = 21
N_TURNS = 4  # turns 0..3 in the main replay; (c) and (d) add one more to some sessions
OVERLOAD = 1.5
WORDS = ["parse", "config", "index", "block", "cache", "route", "engine", "session", "token", "prefix", "hash", "event", "store", "load", "queue", "request", "reply", "worker", "module", "function", "class", "method", "test", "fixture", "error", "retry", "timeout", "buffer", "stream", "socket", "server", "client", "batch", "chunk", "tier", "global", "local", "evict", "warm", "cold", "agent", "tool", "file", "patch", "diff"]
SYSTEM = (
    "You are a coding agent in a Python repository. Read files before you edit them, keep each "
    "change small, run the tests, and report what you changed and why."
)


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


@dataclass
class Session:
    sid: int
    users: list[str]  # the user message of every turn, fixed up front so replays are comparable
    messages: list[dict[str, str]] = field(default_factory=list)
    home: str | None = None  # instance of the first turn
    visited: set[str] = field(default_factory=set)  # every instance a turn ran on (its KV may be there)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.home = None
        self.visited = set()


@dataclass
class Turn:
    sid: int
    turn: int
    instance: str
    reason: str
    local_hit: int
    prompt_tokens: int
    gateway_prompt_tokens: int
    cached: int


def make_sessions(seed: int) -> list[Session]:
    rng = random.Random(seed)
    out = []
    for sid in range(N_SESSIONS):
        users = [f"Task {sid}.{t}: " + " ".join(sentence(rng, 9) for _ in range(4)) for t in range(N_TURNS + 2)]
        s = Session(sid, users)
        s.reset()
        out.append(s)
    return out


class Client:
    def __init__(self, http: aiohttp.ClientSession, gateway: str, metrics: str, health: str) -> None:
        self.http = http
        self.gateway = gateway
        self.metrics_url = metrics
        self.health_url = health

    async def turn(self, s: Session, max_tokens: int = 24) -> Turn:
        """Send the session's next turn through the gateway and append the reply to it."""
        turn = sum(1 for m in s.messages if m["role"] == "assistant")
        s.messages.append({"role": "user", "content": s.users[turn]})
        body = {"model": "tiny", "messages": s.messages, "max_tokens": max_tokens, "min_tokens": min(8, max_tokens),
                "temperature": 0.0, "ignore_eos": max_tokens > 24}
        async with self.http.post(f"{self.gateway}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            h = resp.headers
        s.messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        usage = data["usage"]
        t = Turn(s.sid, turn, h["X-SMetric-Instance"], h["X-SMetric-Reason"], int(h["X-SMetric-Local-Hit"]),
                 usage["prompt_tokens"], int(h["X-SMetric-Prompt-Tokens"]),
                 (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if turn == 0:
            s.home = t.instance
        s.visited.add(t.instance)
        return t

    async def completion(self, token_ids: list[int], turn: int) -> Turn:
        body = {"model": "tiny", "prompt": token_ids, "max_tokens": 1}
        headers = {"X-SMetric-Turn": str(turn)}
        async with self.http.post(f"{self.gateway}/v1/completions", json=body, headers=headers) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            h = resp.headers
        usage = data["usage"]
        return Turn(-1, turn, h["X-SMetric-Instance"], h["X-SMetric-Reason"], int(h["X-SMetric-Local-Hit"]),
                    usage["prompt_tokens"], int(h["X-SMetric-Prompt-Tokens"]),
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with self.http.get(self.metrics_url) as resp:
            text = await resp.text()
        return {
            (smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
        }

    async def gateway_metrics(self) -> dict[str, float]:
        """The gateway's own counters that say where a request went (fallbacks, route round trips)."""
        async with self.http.get(f"{self.gateway}/metrics") as resp:
            text = await resp.text()
        return {
            f"{smp.name}{dict(sorted(smp.labels.items()))}": smp.value
            for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.value and any(k in smp.name for k in ("fallback", "route_rtt", "retries", "failures", "in_flight",
                                                          "in_stage", "requests_total", "untokenized"))
        }

    async def metric(self, name: str, **labels: str) -> float:
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))), 0.0)

    async def wait_metric(self, name: str, pred: Any, timeout_s: float = 20.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout_s
        while True:
            v = await self.metric(name, **labels)
            if pred(v):
                return v
            if time.monotonic() >= deadline:
                polls = {k: v for k, v in (await self.metrics()).items() if "engine" in k[0] or "in_flight" in k[0]}
                raise AssertionError(f"{name}{labels} stuck at {v}; controller engine-poll metrics: {polls}")
            await asyncio.sleep(0.2)

    async def reset_cache(self, engine: launch.RunningEngine) -> None:
        """Empty an engine's prefix cache and make sure the controller saw it go."""
        before = await self.metric("smetric_kv_events_total", backend=engine.instance_id, kind="AllBlocksCleared")
        for _ in range(50):
            async with self.http.post(f"{engine.http_url}/reset_prefix_cache") as resp:
                if resp.status == 200 and (await resp.json()).get("success"):
                    break
            await asyncio.sleep(0.2)  # blocks still held by a request that is finishing
        else:
            raise AssertionError(f"{engine.instance_id}: /reset_prefix_cache kept failing")
        # The engine publishes AllBlocksCleared at its next step: give it one (a raw, unrelated prompt).
        body = {"model": "tiny", "prompt": "flush", "max_tokens": 1}
        async with self.http.post(f"{engine.http_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
        await self.wait_metric("smetric_kv_events_total", lambda v: v > before,
                               backend=engine.instance_id, kind="AllBlocksCleared")

    async def set_policy(self, config_path: Path, cfg: dict[str, Any], name: str) -> None:
        """Hot-reload the controller's policy (it watches the file) and wait until it is in force."""
        cfg["policy"]["name"] = name
        up.write_config(cfg, config_path)
        deadline = time.monotonic() + 15.0
        while True:
            async with self.http.get(self.health_url) as resp:
                if (await resp.json()).get("policy") == name:
                    return
            assert time.monotonic() < deadline, f"policy {name} not in force"
            await asyncio.sleep(0.2)


async def replay(client: Client, sessions: list[Session], turns: int) -> list[Turn]:
    """Round by round, like agents thinking between turns: every session's turn k, then k+1."""
    out = []
    for _ in range(turns):
        for s in sessions:
            out.append(await client.turn(s))
    return out


def expected_hit(t: Turn) -> int:
    # vLLM never serves a prompt entirely from cache: at least its last token is computed, so the
    # engine's hit is capped at the full blocks of prompt_tokens - 1. The controller predicts
    # what the engine holds; the engine reports what it used.
    return min(t.local_hit, (t.prompt_tokens - 1) // BLOCK * BLOCK)


def summary(turns: list[Turn]) -> dict[str, Any]:
    follow = [t for t in turns if t.turn > 0]
    return {
        "requests": len(turns),
        "cached_tokens": sum(t.cached for t in turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "reasons": dict(Counter(t.reason for t in turns)),
        "follow_ups": len(follow),
    }


def engine_children(engine: launch.RunningEngine) -> list[int]:
    """The engine's core and worker processes: its process group minus the API server."""
    pgid = engine.process.pid
    return [pid for pid in up.group_members(pgid) if pid != pgid]


@contextlib.contextmanager
def paused(engine: launch.RunningEngine) -> Iterator[None]:
    """SIGSTOP the engine's core and workers (the API server keeps answering); SIGCONT after."""
    pids = engine_children(engine)
    assert pids, f"{engine.instance_id}: no engine-core process found"
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def task_state(task: asyncio.Task[Any]) -> str:
    """What became of a request sent in the background: still waiting, its turn, or its error."""
    if not task.done():
        return "no answer yet"
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return f"failed: {exc!r}" if exc is not None else f"answered: {task.result()}"


def log_tails(folder: Path, names: tuple[str, ...] = ("controller.log", "gateway.log"), lines: int = 40) -> None:
    for name in names:
        path = folder / name
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            log.error("---- last %d lines of %s ----\n%s", len(tail), name, "\n".join(tail))


async def test_smetric_routing_on_real_engines(
    start_engines: Any, tmp_path: Path, record_property: Any
) -> None:
    t_start = time.monotonic()
    # One core each. vLLM's CPU auto-binding pins every engine's OpenMP threads to the same first
    # core, so a generating engine would starve the other one's forward passes (minutes for a
    # 24-token reply in (c)). Started one after the other: the fixture numbers engines in order.
    # --max-num-seqs 1: the replay sends one request at a time anyway; it keeps each engine's
    # work to one sequence on this shared 2-core box.
    engines = []
    for core in ("0", "1"):
        engines += await asyncio.to_thread(start_engines, 1, block_size=BLOCK, extra_args=("--max-num-seqs", "1"),
                                           extra_env={"VLLM_CPU_OMP_THREADS_BIND": core})
    ids = [e.instance_id for e in engines]
    route_port, metrics_port, gw_port = launch.free_ports(3)
    cfg = up.controller_config(engines, route_url=f"tcp://127.0.0.1:{route_port}", metrics_port=metrics_port,
                               policy="smetric", policy_overrides={"overload": OVERLOAD},
                               # A generating engine's API server answers /metrics in seconds on this
                               # 2-core box: poll often, and let each poll wait a few seconds.
                               metrics_poll_s=1.0,
                               # A shared 2-core box can stall an idle engine's /metrics for many
                               # seconds; do not let that drop it (and its index) mid-test.
                               load_overrides={"instance_timeout_s": 300.0, "metrics_timeout_s": 5.0})
    config_path = up.write_config(cfg, tmp_path / "smetric.yaml")
    procs: list[Any] = []
    results: dict[str, Any] = {"engine_start_s": round(time.monotonic() - t_start, 1)}
    try:
        procs.append(await asyncio.to_thread(up.start_controller, config_path, metrics_port, tmp_path))
        # A generating engine starves this 2-core box: give the controller seconds, not the
        # default one, before the gateway falls back to round-robin.
        procs.append(await asyncio.to_thread(up.start_gateway, config_path, gw_port, tmp_path,
                                             extra_args=("--route-timeout-s", "5")))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
            client = Client(http, f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{metrics_port}/metrics",
                            f"http://127.0.0.1:{metrics_port}/healthz")
            sessions = make_sessions(seed=7)

            # ---- SMetric replay: (a) stickiness and spread, (b) predicted vs engine hits -----------
            t0 = time.monotonic()
            turns = await replay(client, sessions, N_TURNS)
            results["smetric"] = {**summary(turns), "replay_s": round(time.monotonic() - t0, 1)}
            homes = Counter(s.home for s in sessions)
            follow = [t for t in turns if t.turn > 0]
            home_of = {s.sid: s.home for s in sessions}
            sticky = sum(t.instance == home_of[t.sid] for t in follow) / len(follow)
            results["smetric"]["first_turns"] = dict(homes)
            results["smetric"]["return_to_first_instance"] = round(sticky, 3)
            assert set(homes) == set(ids) and min(homes.values()) >= N_SESSIONS // 4, homes
            assert sticky >= 0.90, results
            # The gateway's token ids (engine /tokenize + chat template) are the engine's prompt.
            assert all(t.gateway_prompt_tokens == t.prompt_tokens for t in turns)
            within = [abs(expected_hit(t) - t.cached) <= BLOCK for t in follow]
            exact = sum(expected_hit(t) == t.cached for t in follow)
            results["smetric"]["hit_within_one_block"] = round(sum(within) / len(within), 3)
            results["smetric"]["hit_exact"] = exact
            misses = [t for t, ok in zip(follow, within) if not ok]
            results["smetric"]["hit_capped_by_last_token"] = sum(expected_hit(t) != t.local_hit for t in follow)
            log.info("e2e routing, SMetric replay: %s", json.dumps(results))
            assert sum(within) / len(within) >= 0.95, misses

            # The last-token cap made visible: a prompt of exactly two blocks, sent twice. The index
            # holds both blocks after the first; the engine still computes the last block again.
            ids = list(range(100, 100 + 2 * BLOCK))
            first = await client.completion(ids, turn=0)
            await asyncio.sleep(0.2)  # KV events trail the response by milliseconds
            again = await client.completion(ids, turn=1)
            results["full_prompt_repeat"] = {"predicted": again.local_hit, "cached": again.cached}
            assert again.instance == first.instance and again.reason == "sticky"
            assert (again.local_hit, again.cached, expected_hit(again)) == (2 * BLOCK, BLOCK, BLOCK)

            # ---- (c) a busy engine sheds its sessions --------------------------------------------------
            hot, cold = engines[0], engines[1]
            # Movers are sessions whose KV is only on hot: one that ever moved to cold (a fallback in the
            # replay) still holds a prefix there, and sticking to cold is then right, not a fallback.
            homed = [s for s in sessions if s.visited == {hot.instance_id}]
            anchor, movers = homed[0], homed[1:6]
            assert len(movers) >= 3, [(s.sid, s.visited) for s in sessions]
            # hot's engine core is paused first (its API server keeps answering /tokenize and /metrics and
            # takes requests in), then a long turn of one of hot's sessions goes there (sticky) and stays
            # in flight until hot resumes. The controller counts a request from the moment it answers
            # `route`, so hot carries 1 against cold's 0: above OVERLOAD x mean for every follow-up of
            # hot's other sessions. (Pausing only once the controller counted the turn raced the
            # generation: 1,200 tokens of the tiny model take 1.4-2.4 s here, so the pause could come
            # after the turn had ended, or a poll of the controller's /metrics miss the whole window.
            # vLLM's own running/waiting gauges are not used: on this 2-core box they were seen to stay
            # at 0 for a minute while the engine's log showed a queue.)
            with paused(hot):
                long_task = asyncio.create_task(client.turn(anchor, max_tokens=1200))
                try:
                    await client.wait_metric("smetric_instance_in_flight", lambda v: v >= 1, timeout_s=30.0,
                                             backend=hot.instance_id)
                except AssertionError as exc:
                    gw = await client.gateway_metrics()
                    state = task_state(long_task)
                    long_task.cancel()
                    raise AssertionError(
                        f"overload phase: the controller never counted the long turn on {hot.instance_id} "
                        f"({exc}); long turn: {state}; gateway: {gw}; results so far: {results}") from None
                # Its end would release hot's load and send the follow-ups below to a paused engine.
                assert not long_task.done(), f"the long turn ended while hot was paused: {task_state(long_task)}"
                before = await client.metric("smetric_route_decisions_total", policy="smetric",
                                             reason="overloaded_fallback")
                moved = [await client.turn(s) for s in movers]
                after = await client.metric("smetric_route_decisions_total", policy="smetric",
                                            reason="overloaded_fallback")
            long = await long_task
            results["overload"] = {"moved": [(t.sid, t.instance, t.reason) for t in moved],
                                   "busy": (long.sid, long.instance, long.reason)}
            log.info("e2e routing, overload phase: %s", results["overload"])
            assert (long.instance, long.reason) == (hot.instance_id, "sticky"), long
            assert len(moved) == 5
            assert all(t.reason == "overloaded_fallback" and t.instance == cold.instance_id for t in moved), moved
            assert after - before == len(moved)
            await client.wait_metric("smetric_instance_in_flight", lambda v: v == 0, timeout_s=40.0,
                                     backend=hot.instance_id)

            # ---- (d) after a prefix-cache reset, the sessions that lived there rebalance -------------
            await client.reset_cache(cold)
            # Sessions whose KV is only on cold: one that ever moved (a fallback) still holds a prefix
            # elsewhere, and sticking there is right.
            evicted = [s for s in sessions if s.visited == {cold.instance_id}][:4]
            assert evicted
            rebalanced = [await client.turn(s) for s in evicted]
            results["evicted"] = [(t.sid, t.instance, t.reason, t.local_hit) for t in rebalanced]
            assert all(t.reason == "evicted_fallback" for t in rebalanced), rebalanced
            assert await client.metric("smetric_route_decisions_total", policy="smetric",
                                       reason="evicted_fallback") >= len(rebalanced)

            # ---- the same replay under load_balance, from empty caches -----------------------------
            await client.set_policy(config_path, cfg, "load_balance")
            for e in engines:
                await client.reset_cache(e)
            for s in sessions:
                s.reset()
            t0 = time.monotonic()
            lb_turns = await replay(client, sessions, N_TURNS)
            results["load_balance"] = {**summary(lb_turns), "replay_s": round(time.monotonic() - t0, 1)}
            home_of = {s.sid: s.home for s in sessions}
            lb_follow = [t for t in lb_turns if t.turn > 0]
            results["load_balance"]["return_to_first_instance"] = round(
                sum(t.instance == home_of[t.sid] for t in lb_follow) / len(lb_follow), 3)
    except BaseException:
        log_tails(tmp_path)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=10.0)
    results["total_s"] = round(time.monotonic() - t_start, 1)
    (tmp_path / "e2e_routing_results.json").write_text(json.dumps(results, indent=2))
    record_property("e2e_routing", json.dumps(results))
    log.info("e2e routing results: %s", json.dumps(results))
    print("\ne2e routing results:", json.dumps(results, indent=2))
    sm, lb = results["smetric"]["cached_tokens"], results["load_balance"]["cached_tokens"]
    assert sm > lb, f"SMetric cached {sm} tokens, load_balance {lb}"

