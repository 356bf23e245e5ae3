"""Loader for the WEKA Claude Code traces (kv-cache-tester format, one conversation per JSON file).

Each conversation is read from a folder, a single JSON file, or streamed member by member out of a
(compressed) tar archive, so the ~400 MB of JSON never sits in memory at once.
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

from smetric_lmc.lab.workload.chain import SharedPrefix, chain_session, scope_seed
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload

log = logging.getLogger(__name__)

WEKA_BLOCK_SIZE = 64
MAIN_AGENT = "main"


def _iter_conversations(path: Path, limit: int | None) -> Iterator[tuple[str, bytes]]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.json") if p.is_file())
        for p in files[:limit]:
            yield p.name, p.read_bytes()
        return
    if path.suffix == ".json":
        yield path.name, path.read_bytes()
        return
    count = 0
    # Stream mode: members are decompressed in order and read one at a time.
    with tarfile.open(path, mode="r|*") as tf:
        for member in tf:
            if limit is not None and count >= limit:
                return
            if not member.isfile() or not member.name.endswith(".json"):
                continue
            fh = tf.extractfile(member)
            if fh is None:
                continue
            count += 1
            yield Path(member.name).name, fh.read()


class _Builder:
    def __init__(self, shared_prefix: bool) -> None:
        self.shared_prefix = shared_prefix
        self.shared: dict[str, SharedPrefix] = {}
        self.sessions: list[TraceSession] = []
        self.n_subagents = 0
        # system + tool tokens per session: what the shared-prefix mapping and the fit use
        self.prompt_tokens: dict[str, int] = {}
        self.agent_types: dict[str, str] = {}

    def conversation(self, conv: dict[str, Any]) -> None:
        cid = str(conv.get("id", f"conv{len(self.sessions)}"))
        bs = int(conv.get("block_size", WEKA_BLOCK_SIZE))
        if bs != WEKA_BLOCK_SIZE:
            raise ValueError(f"{cid}: block_size {bs}, expected {WEKA_BLOCK_SIZE}")
        # "local" scope: ids mean something only inside one conversation, sub-agents included.
        seed = scope_seed("weka:" + cid)
        self._session(conv, cid, None, 0.0, seed, MAIN_AGENT)

    def _session(
        self, node: dict[str, Any], sid: str, parent: str | None, offset: float, seed: int, agent: str
    ) -> None:
        calls: list[dict[str, Any]] = []
        children: list[dict[str, Any]] = []
        for r in node.get("requests", []):
            (children if r.get("type") == "subagent" else calls).append(r)
        shared = None
        shared_blocks = 0
        sp_tokens = int(node.get("system_tokens", 0) or 0) + int(node.get("tool_tokens", 0) or 0)
        self.prompt_tokens[sid] = sp_tokens
        if agent != MAIN_AGENT:
            self.agent_types[sid] = agent
        if self.shared_prefix:
            shared = self.shared.setdefault(agent, SharedPrefix("claude-code:" + agent))
            shared_blocks = sp_tokens // WEKA_BLOCK_SIZE
        ids, turns = chain_session([r.get("hash_ids", []) for r in calls], seed, shared, shared_blocks)
        requests = [
            TraceRequest(
                arrival=float(r.get("t", 0.0)),
                input_tokens=int(r.get("in", 0)),
                output_tokens=int(r.get("out", 0)),
                block_ids=b,
                think_time=float(r.get("think_time", 0.0) or 0.0),
                kind=str(r.get("type", "n")),
                turn=t,
            )
            for r, b, t in zip(calls, ids, turns, strict=True)
        ]
        if requests:
            self.sessions.append(TraceSession(sid, requests, parent, offset))
        elif parent is None:
            log.warning("conversation %s has no requests", sid)
        for k, child in enumerate(children):
            self.n_subagents += 1
            cid = f"{sid}/{child.get('agent_id', f'sub{k}')}"
            agent_type = str(child.get("subagent_type", "subagent"))
            # A sub-agent's t is relative to its parent's start; start_offset is relative to the root.
            self._session(child, cid, sid, offset + float(child.get("t", 0.0)), seed, agent_type)


def load_weka(
    path: str | Path,
    *,
    shared_prefix: bool = False,
    limit: int | None = None,
    progress: bool = True,
) -> Workload:
    """Load WEKA Claude Code conversations from a .tar(.xz) archive, a folder, or one JSON file.

    `limit` keeps the first N conversations in storage order (sorted names for a folder). With
    `shared_prefix`, the leading floor((system_tokens + tool_tokens) / 64) blocks of each session's
    first request take ids shared by all sessions of the same agent type (main agent, or each
    sub-agent type), exposing the system-prompt reuse that the trace's local id scope hides.
    """
    path = Path(path)
    builder = _Builder(shared_prefix)
    n_conv = 0
    it = _iter_conversations(path, limit)
    for _name, data in tqdm(it, desc=f"loading {path.name}", unit="conv", disable=not progress, total=limit):
        builder.conversation(msgspec.json.decode(data))
        n_conv += 1
    sessions = sorted(builder.sessions, key=lambda s: s.session_id)
    meta: dict[str, Any] = {
        "source": "weka-claude-code",
        "format": "weka",
        "path_name": path.name,
        "conversations": n_conv,
        "subagents": builder.n_subagents,
        "shared_prefix": shared_prefix,
        "absolute_starts": False,
        "license": "Apache-2.0 (callanjfox/kv-cache-tester)",
        "prompt_tokens": builder.prompt_tokens,
        "agent_types": builder.agent_types,
        "notes": [
            "no absolute session start times: root sessions start at 0 and a replay places them",
            "block ids are chained per conversation (local scope); sub-agents share their parent's scope",
        ],
    }
    if shared_prefix:
        meta["notes"].append(
            "system prompt + tool blocks of each session's first request mapped to shared ids per agent type"
        )
    log.info("loaded %d conversations, %d sessions from %s", n_conv, len(sessions), path.name)
    return Workload("weka" + ("-shared" if shared_prefix else ""), WEKA_BLOCK_SIZE, sessions, meta)
