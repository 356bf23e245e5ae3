"""Trace loaders (WEKA, Bailian, Mooncake), native format and format detection."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smetric_lmc.lab.workload import (
    detect_format,
    load_any,
    load_bailian,
    load_mooncake,
    load_native,
    load_weka,
    save_native,
    synthetic,
)
from smetric_lmc.lab.workload.chain import chain_session


def _call(t: float, n_in: int, raw: list[int], *, out: int = 10, think: float = 1.0, kind: str = "n") -> dict:
    return {
        "t": t,
        "type": kind,
        "in": n_in,
        "out": out,
        "hash_ids": raw,
        "think_time": think,
        "api_time": 1.0,
    }


def _conversation(cid: str, base: int = 1) -> dict:
    """Three calls that extend each other, a sub-agent at t=4 with a nested sub-agent, a compaction."""
    a = [base, base + 1, base + 2]
    nested = {
        "t": 1.0,
        "type": "subagent",
        "agent_id": "agent_002",
        "subagent_type": "Plan",
        "system_tokens": 64,
        "tool_tokens": 0,
        "requests": [_call(0.0, 128, [900, 901])],
    }
    sub = {
        "t": 4.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "subagent_type": "Explore",
        "system_tokens": 64,
        "tool_tokens": 64,
        "requests": [_call(0.0, 192, a[:2] + [500]), nested, _call(2.0, 256, a[:2] + [500, 501])],
    }
    return {
        "id": cid,
        "block_size": 64,
        "hash_id_scope": "local",
        "system_tokens": 100,
        "tool_tokens": 60,
        "requests": [
            _call(0.0, 3 * 64 + 5, a, think=0.0),
            _call(3.0, 4 * 64, a + [base + 3], kind="s"),
            sub,
            _call(9.0, 5 * 64 + 63, a + [base + 3, base + 4]),
            _call(20.0, 2 * 64, [base + 50, base + 51]),  # history dropped
        ],
    }


def _write_weka(folder: Path, convs: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for c in convs:
        (folder / f"{c['id']}.json").write_text(json.dumps(c))
    return folder


def test_weka_sessions_turns_and_chaining(tmp_path: Path) -> None:
    folder = _write_weka(tmp_path / "w", [_conversation("trace_a"), _conversation("trace_b")])
    w = load_weka(folder, progress=False)
    ids = {s.session_id: s for s in w.sessions}
    assert set(ids) == {
        "trace_a",
        "trace_a/agent_001",
        "trace_a/agent_001/agent_002",
        "trace_b",
        "trace_b/agent_001",
        "trace_b/agent_001/agent_002",
    }
    main = ids["trace_a"]
    assert [r.turn for r in main.requests] == [0, 1, 2, 0]
    assert [r.kind for r in main.requests] == ["n", "s", "n", "n"]
    assert [len(r.block_ids) for r in main.requests] == [3, 4, 5, 2]
    r0, r1, r2, r3 = main.requests
    assert np.array_equal(r1.block_ids[:3], r0.block_ids)
    assert np.array_equal(r2.block_ids[:4], r1.block_ids)
    assert len(set(r3.block_ids.tolist()) & set(r2.block_ids.tolist())) == 0
    # sub-agents: own sessions, linked, offsets relative to the root, parent's id scope
    sub = ids["trace_a/agent_001"]
    assert sub.parent_id == "trace_a" and sub.start_offset == 4.0
    assert np.array_equal(sub.requests[0].block_ids[:2], r0.block_ids[:2])
    nested = ids["trace_a/agent_001/agent_002"]
    assert nested.parent_id == "trace_a/agent_001" and nested.start_offset == 5.0
    assert w.absolute_start()["trace_a/agent_001/agent_002"] == 5.0
    # local scope: the same raw ids in another conversation are different blocks
    other = ids["trace_b"].requests[0].block_ids
    assert len(set(other.tolist()) & set(r0.block_ids.tolist())) == 0
    assert w.meta["absolute_starts"] is False and w.block_size == 64


def test_weka_shared_prefix(tmp_path: Path) -> None:
    folder = _write_weka(tmp_path / "w", [_conversation("trace_a", 1), _conversation("trace_b", 1000)])
    w = load_weka(folder, shared_prefix=True, progress=False)
    ids = {s.session_id: s for s in w.sessions}
    a, b = ids["trace_a"].requests, ids["trace_b"].requests
    # (100 + 60) // 64 = 2 shared blocks, then the conversations differ
    assert np.array_equal(a[0].block_ids[:2], b[0].block_ids[:2])
    assert a[0].block_ids[2] != b[0].block_ids[2]
    # later requests keep the shared ids, so prefixes still chain
    assert np.array_equal(a[2].block_ids[:3], a[0].block_ids)
    # sub-agent types have their own shared prefix: (64 + 64) // 64 = 2 blocks
    sa, sb = ids["trace_a/agent_001"].requests[0], ids["trace_b/agent_001"].requests[0]
    assert np.array_equal(sa.block_ids[:2], sb.block_ids[:2])
    assert sa.block_ids[0] != a[0].block_ids[0]
    assert w.meta["shared_prefix"] is True


def test_weka_from_tar_xz_and_limit(tmp_path: Path) -> None:
    archive = tmp_path / "t.tar.xz"
    with tarfile.open(archive, "w:xz") as tf:
        for c in [_conversation("trace_a"), _conversation("trace_b")]:
            data = json.dumps(c).encode()
            info = tarfile.TarInfo(f"weka/{c['id']}.json")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    w = load_weka(archive, limit=1, progress=False)
    assert {s.session_id.split("/")[0] for s in w.sessions} == {"trace_a"}
    assert detect_format(archive) == "weka"
    assert load_any(archive, progress=False).meta["conversations"] == 2


def test_weka_real_file(shared: Path) -> None:
    archive = shared / "traces" / "weka-claude-code.tar.xz"
    if not archive.exists():
        pytest.skip(f"{archive} missing")
    w = load_weka(archive, limit=3, progress=False)
    assert w.meta["conversations"] == 3
    extended = 0
    for s in w.sessions:
        for k, r in enumerate(s.requests):
            assert len(r.block_ids) == r.input_tokens // 64
            assert r.block_ids.dtype == np.uint64
            if k and np.array_equal(
                r.block_ids[: len(s.requests[k - 1].block_ids)], s.requests[k - 1].block_ids
            ):
                extended += 1
    # the agent append-only pattern: most follow-ups extend the previous request
    assert extended > 0.8 * (w.n_requests - len(w.sessions))


def _bailian_rows() -> list[dict]:
    sys_prompt = [7, 8, 9]
    return [
        {
            "chat_id": 1,
            "parent_chat_id": -1,
            "timestamp": 100.0,
            "input_length": 60,
            "output_length": 5,
            "type": "text",
            "turn": 1,
            "hash_ids": sys_prompt + [10],
        },
        {
            "chat_id": 2,
            "parent_chat_id": -1,
            "timestamp": 101.5,
            "input_length": 50,
            "output_length": 6,
            "type": "text",
            "turn": 1,
            "hash_ids": sys_prompt,
        },
        {
            "chat_id": 3,
            "parent_chat_id": 1,
            "timestamp": 104.0,
            "input_length": 90,
            "output_length": 7,
            "type": "text",
            "turn": 2,
            "hash_ids": sys_prompt + [10, 11, 12],
        },
        {
            "chat_id": 4,
            "parent_chat_id": 3,
            "timestamp": 110.0,
            "input_length": 100,
            "output_length": 8,
            "type": "image",
            "turn": 3,
            "hash_ids": sys_prompt + [10, 11, 12, 13],
        },
        # parent 99 is not in the file (sampled trace): its own session, recorded turn 4 -> 3 earlier
        {
            "chat_id": 5,
            "parent_chat_id": 99,
            "timestamp": 120.0,
            "input_length": 40,
            "output_length": 9,
            "type": "text",
            "turn": 4,
            "hash_ids": [42, 43],
        },
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bailian(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "qwen_traceA_blksz_16.jsonl", _bailian_rows())
    assert detect_format(path) == "bailian"
    w = load_bailian(path)
    assert w.block_size == 16 and w.meta["absolute_starts"] is True
    s = {x.session_id: x for x in w.sessions}
    assert set(s) == {"chat1", "chat2", "chat5"}
    chain = s["chat1"].requests
    assert [r.turn for r in chain] == [0, 1, 2]
    assert [r.arrival for r in chain] == [0.0, 4.0, 10.0]
    assert [r.think_time for r in chain] == [0.0, 4.0, 6.0]
    assert chain[2].kind == "image"
    assert s["chat2"].start_offset == 1.5 and s["chat5"].start_offset == 20.0
    assert s["chat5"].requests[0].turn == 3
    # one global id space: the shared system prompt has the same ids in both sessions
    assert np.array_equal(s["chat2"].requests[0].block_ids, chain[0].block_ids[:3])
    assert np.array_equal(chain[2].block_ids[:4], chain[0].block_ids)


def test_mooncake(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 2000, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 5]},
        {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 600, "output_length": 30, "hash_ids": [7]},
    ]
    path = _write_jsonl(tmp_path / "conversation_trace.jsonl", rows)
    assert detect_format(path) == "mooncake"
    w = load_mooncake(path)
    assert w.block_size == 512 and w.meta["no_sessions"] is True
    assert "no sessions" in " ".join(w.meta["notes"])
    assert [s.start_offset for s in w.sessions] == [0.0, 0.5, 2.0]
    assert all(len(s.requests) == 1 and s.requests[0].turn == 0 for s in w.sessions)
    first, _, last = (s.requests[0].block_ids for s in w.sessions)
    assert np.array_equal(last[:2], first) and last[2] not in first


def test_native_round_trip(tmp_path: Path) -> None:
    bailian = load_bailian(_write_jsonl(tmp_path / "b.jsonl", _bailian_rows()))
    folder = _write_weka(tmp_path / "w", [_conversation("trace_a")])
    for w in (
        synthetic(20, seed=3, scale=0.05),
        bailian,
        load_weka(folder, shared_prefix=True, progress=False),
    ):
        path = save_native(w, tmp_path / f"{w.name}.smw")
        assert detect_format(path) == "native"
        back = load_native(path)
        assert back.name == w.name and back.block_size == w.block_size and back.meta == w.meta
        assert len(back.sessions) == len(w.sessions)
        for a, b in zip(w.sessions, back.sessions, strict=True):
            assert (a.session_id, a.parent_id, a.start_offset) == (b.session_id, b.parent_id, b.start_offset)
            assert a.requests == b.requests
        assert load_any(path).n_requests == w.n_requests
    # prefix views are restored: a session's extending requests share one buffer
    s = back.sessions[0].requests
    assert s[0].block_ids.base is not None and s[0].block_ids.base is s[1].block_ids.base


def test_detect_rejects_unknown(tmp_path: Path) -> None:
    p = tmp_path / "x.txt"
    p.write_text("hello\n")
    with pytest.raises(ValueError):
        detect_format(p)


raw_lists = st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(raw_lists)
def test_chained_ids_equal_iff_prefix_equal(raws: list[list[int]]) -> None:
    ids, turns = chain_session(raws, seed=1)
    assert turns[0] == 0 and all(t >= 0 for t in turns)
    for i, a in enumerate(raws):
        for j, b in enumerate(raws):
            for k in range(min(len(a), len(b))):
                assert (ids[i][k] == ids[j][k]) == (a[: k + 1] == b[: k + 1])
