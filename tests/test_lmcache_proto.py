"""LMCache 0.5.x controller wire structs against recorded frames and LMCache's own codec."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from kit.lmcache_venv import run_in_lmcache_venv

from smetric_lmc.controller import lmcache_proto as P


@pytest.fixture(scope="module")
def rec(shared: Path) -> dict:
    p = shared / "fixtures" / "lmcache_worker_messages.json"
    if not p.exists():
        pytest.skip(f"{p} missing")
    return json.loads(p.read_text())


def _plain(msg: msgspec.Struct) -> object:
    # Tuples become lists, as in the recorded JSON.
    return json.loads(msgspec.json.encode(msg))


def _frames(rec: dict, direction: str) -> list[tuple[str, bytes]]:
    out = []
    for ex in rec["exchanges"]:
        for h in ex.get(direction, []):
            if h:
                out.append((ex["note"], bytes.fromhex(h)))
    return out


def test_standalone_messages_roundtrip_bytes(rec: dict) -> None:
    assert len(rec["messages"]) >= 20
    for m in rec["messages"]:
        raw = bytes.fromhex(m["msgpack_hex"])
        msg = P.decode(raw)
        assert type(msg).__name__ == m["class"]
        assert _plain(msg) == m["fields"]
        assert P.encode(msg) == raw, m["class"]
        from_json = P.decode(m["json"].encode())
        assert from_json == msg
        assert P.encode_json(msg) == m["json"].encode()


def test_every_recorded_worker_frame_decodes(rec: dict) -> None:
    decoded = 0
    for ex in rec["exchanges"]:
        frames = [bytes.fromhex(h) for h in ex["sent_frames_hex"] if h]
        expected = ex["sent_messages"]
        if not expected:  # the recorded garbage frame
            with pytest.raises(P.ProtocolError, match="Expected `object`, got `None`"):
                P.decode(frames[0])
            continue
        assert len(frames) == len(expected)
        for raw, exp in zip(frames, expected, strict=True):
            msg = P.decode(raw)
            assert type(msg).__name__ == exp["class"]
            assert _plain(msg) == exp["fields"]
            decoded += 1
    assert decoded == 15


def test_recorded_replies_reencode_identically(rec: dict) -> None:
    replies = _frames(rec, "reply_frames_hex")
    assert len(replies) == 10
    for note, raw in replies:
        msg = P.decode(raw)
        assert isinstance(msg, P.ReplyMsg), note
        assert P.encode(msg) == raw, note


def test_replies_built_from_scratch_match_recorded_bytes(rec: dict) -> None:
    by_note = {ex["note"]: bytes.fromhex(ex["reply_frames_hex"][1]) for ex in rec["exchanges"]
               if ex.get("reply_frames_hex")}
    sync_id = "vllm-a_0_5f3c2a1b"
    built = {
        "RegisterMsg on the reply ROUTER; reply carries heartbeat_url":
            P.RegisterRetMsg(extra_config={"heartbeat_url": "127.0.0.1:18082"}),
        "first heartbeat after controller start -> FullSyncCommand(controller_restart)":
            P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="controller_restart")]),
        "full sync start": P.FullSyncStartRetMsg(sync_id=sync_id, accepted=True),
        "full sync status after end": P.FullSyncStatusRetMsg(
            sync_id=sync_id, is_complete=True, global_progress=1.0, can_exit_freeze=True),
        "heartbeat after completed sync -> no commands": P.HeartbeatRetMsg(),
        "P2P lookup by B: A holds chunks 0..2 (chunk 3 was evicted)": P.BatchedP2PLookupRetMsg(
            layout_info=[("vllm-a", "LocalCPUBackend", 3, "127.0.0.1:8600")]),
        "a PUSH-only message sent on the reply ROUTER -> ErrorMsg 'Unknown message type'":
            P.ErrorMsg(error=P.unknown_type_error("DeRegisterMsg")),
        "undecodable payload (msgpack nil) -> ErrorMsg with decode error text":
            P.ErrorMsg(error="Expected `object`, got `None`"),
        "heartbeat from unknown worker -> auto re-register + FullSyncCommand(worker_re_registered)":
            P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="worker_re_registered")]),
    }
    for note, msg in built.items():
        assert P.encode(msg) == by_note[note], note


@pytest.mark.parametrize(
    ("frame", "needle"),
    [
        (b"", "truncated"),
        (b"\xc1\xc1", "invalid"),
        (b"\x93\x01\x02\x03", "Expected `object`, got `array`"),
        (msgspec.msgpack.encode({"type": "NoSuchMsg"}), "Invalid value 'NoSuchMsg'"),
        (msgspec.msgpack.encode({"instance_id": "a"}), "Object missing required field `type`"),
        (msgspec.msgpack.encode({"type": "HeartbeatMsg", "instance_id": 5, "worker_id": 0, "ip": "x",
                                 "port": 1, "peer_init_url": None}), "Expected `str`, got `int`"),
        (msgspec.msgpack.encode({"type": "BatchedKVOperationMsg", "instance_id": "a", "worker_id": 0,
                                 "location": "L", "operations": [{"op_type": "pin", "key": 1,
                                                                  "seq_num": 0}]}), "Invalid enum value 'pin'"),
        (msgspec.msgpack.encode({"type": "FullSyncBatchMsg", "instance_id": "a", "worker_id": 0,
                                 "location": "L", "sync_id": "s", "batch_id": 0, "keys": ["x"]}),
         "Expected `int`, got `str`"),
        (b"{not json", "JSON"),
        (b'{"type": "RegisterMsg"}', "missing required field"),
        (msgspec.msgpack.encode({"type": "ClearMsg", "event_id": "e", "instance_id": "a", "location": "L"}),
         "Unknown message type: <class 'lmcache.v1.cache_controller.message.ClearMsg'>"),
    ],
)
def test_bad_frames_raise_protocol_error_only(frame: bytes, needle: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode(frame)
    assert needle.lower() in str(info.value).lower()


def test_chunk_hash_range_signed_and_unsigned() -> None:
    for key in (-(2**63), -1, 0, 2**63 - 1, 2**64 - 1):
        m = P.BatchedKVOperationMsg(instance_id="i", worker_id=0, location="LocalCPUBackend",
                                    operations=[P.KVOpEvent(op_type="admit", key=key, seq_num=0)])
        assert P.decode(P.encode(m)) == m
        assert P.decode(P.encode_json(m)) == m


# ---- against LMCache's own classes (subprocess in the LMCache venv) ----

_LMCACHE_CROSS = r"""
import json, sys, msgspec
from lmcache.v1.cache_controller import message as M
from lmcache.v1.cache_controller.commands import FullSyncCommand
req = json.loads(sys.stdin.read())
out = {"decoded": [], "produced": {}}
for h in req["ours"]:
    msg = msgspec.msgpack.decode(bytes.fromhex(h), type=M.Msg)
    out["decoded"].append([type(msg).__name__, msgspec.msgpack.encode(msg).hex()])
ops = [M.KVOpEvent(op_type=M.OpType.ADMIT, key=k, seq_num=i) for i, k in enumerate(req["keys"])]
ops.append(M.KVOpEvent(op_type=M.OpType.EVICT, key=req["keys"][0], seq_num=len(ops)))
produced = [
    M.RegisterMsg(instance_id="w", worker_id=1, ip="127.0.0.1", port=8500, peer_init_url="127.0.0.1:8600"),
    M.HeartbeatMsg(instance_id="w", worker_id=1, ip="127.0.0.1", port=8500, peer_init_url=None),
    M.BatchedKVOperationMsg(instance_id="w", worker_id=1, location="LocalDiskBackend", operations=ops),
    M.FullSyncStartMsg(instance_id="w", worker_id=1, location="LocalCPUBackend", sync_id="s",
                       total_keys=3, batch_count=2),
    M.FullSyncBatchMsg(instance_id="w", worker_id=1, location="LocalCPUBackend", sync_id="s",
                       batch_id=1, keys=req["keys"]),
    M.FullSyncEndMsg(instance_id="w", worker_id=1, location="LocalCPUBackend", sync_id="s",
                     actual_total_keys=3),
    M.FullSyncStatusMsg(instance_id="w", worker_id=1, sync_id="s"),
    M.BatchedP2PLookupMsg(hashes=req["keys"], instance_id="w", worker_id=1),
    M.DeRegisterMsg(instance_id="w", worker_id=1, ip="127.0.0.1", port=8500),
    M.KVEvictMsg(instance_id="w", worker_id=1, key=5, location="LocalCPUBackend"),
    M.HeartbeatRetMsg(commands=[FullSyncCommand(reason="sync_failed_retry", args={"n": 1})]),
    M.FullSyncStatusRetMsg(sync_id="s", is_complete=False, global_progress=0.25,
                           can_exit_freeze=False, missing_batches=[0, 2]),
    M.ErrorMsg(error="boom"),
]
out["produced"] = [[type(m).__name__, msgspec.msgpack.encode(m).hex(), msgspec.json.encode(m).decode()]
                   for m in produced]
print(json.dumps(out))
"""


def _our_replies() -> list[msgspec.Struct]:
    return [
        P.RegisterRetMsg(extra_config={"heartbeat_url": "127.0.0.1:8082"}),
        P.RegisterRetMsg(),
        P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="controller_restart")]),
        P.HeartbeatRetMsg(commands=[P.FullSyncCommand(reason="x", args={"a": [1, 2]})]),
        P.HeartbeatRetMsg(),
        P.FullSyncStartRetMsg(sync_id="s", accepted=False, error_msg="nope"),
        P.FullSyncStatusRetMsg(sync_id="s", is_complete=False, global_progress=0.5,
                               can_exit_freeze=False, missing_batches=[1, 3]),
        P.BatchedP2PLookupRetMsg(layout_info=[("a", "LocalCPUBackend", 7, "127.0.0.1:8600")]),
        P.BatchedP2PLookupRetMsg(layout_info=[("", "", 0, "")]),
        P.ErrorMsg(error=P.unknown_type_error("DeRegisterMsg")),
    ]


@pytest.mark.integration
def test_cross_codec_with_lmcache_classes() -> None:
    ours = _our_replies()
    keys = [-9006915360733114755, 6249281391258955993, 2**64 - 1]
    stdin = json.dumps({"ours": [P.encode(m).hex() for m in ours], "keys": keys}).encode()
    res = json.loads(run_in_lmcache_venv(_LMCACHE_CROSS, stdin=stdin, timeout=120))
    # LMCache decodes every reply we send into its own class and re-encodes the same bytes.
    for msg, (name, reencoded) in zip(ours, res["decoded"], strict=True):
        assert name == type(msg).__name__
        assert bytes.fromhex(reencoded) == P.encode(msg)
    # We decode what LMCache's classes encode (msgpack and JSON) and re-encode identical bytes.
    assert len(res["produced"]) == 13
    for name, hexed, js in res["produced"]:
        raw = bytes.fromhex(hexed)
        msg = P.decode(raw)
        assert type(msg).__name__ == name
        assert P.encode(msg) == raw
        assert P.decode(js.encode()) == msg
        assert P.encode_json(msg) == js.encode()
