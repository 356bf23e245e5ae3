"""Hash chains against the recorded outputs of real vLLM 0.32 and LMCache 0.5.6."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_hashes import (
    VLLM_HASH_ALGOS,
    vllm_block_hash_from_digest,
    vllm_block_preimage,
    vllm_chain,
    vllm_digests,
    vllm_none_hash,
    vllm_sha256_cbor_chain,
    vllm_sha256_cbor_digests,
)

from smetric_lmc import hashing
from smetric_lmc.hashing import (
    FAST_ROOT,
    fast_chain,
    fast_chain_from_bytes,
    fast_root,
    lmcache_chunk_chain,
    lmcache_root,
    python_str_hash,
    token_bytes,
    vllm_none_hash_seed,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SMETRIC_SHARED", REPO_ROOT.parent / "shared"))
FIXTURES = SHARED / "fixtures"


def _fixture(name: str) -> dict[str, Any]:
    path = FIXTURES / name
    if not path.is_file():
        pytest.skip(f"fixture {name} not found under {FIXTURES} (set SMETRIC_SHARED to the shared directory)")
    with path.open() as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def vllm_events() -> dict[str, Any]:
    return _fixture("vllm_kv_events.json")


@pytest.fixture(scope="module")
def lmcache_chunks() -> dict[str, Any]:
    return _fixture("lmcache_chunk_hashes.json")


# --------------------------------------------------------------------------- vLLM fixture

# The capture ran with PYTHONHASHSEED unset (fixture README), so vLLM used its default seed.
VLLM_SEED = "vllm-none-hash"


def test_vllm_request_prompt_hashes(vllm_events: dict[str, Any]) -> None:
    checked = 0
    for req in vllm_events["requests"]:
        if "prompt_token_ids" not in req:
            continue
        toks = req["prompt_token_ids"]
        got = vllm_sha256_cbor_chain(toks, 32, none_hash_seed=VLLM_SEED)
        assert got == req["prompt_full_block_hashes"]
        assert len(got) == len(toks) // 32
        checked += 1
    assert checked == 12


def test_vllm_every_stored_block(vllm_events: dict[str, Any]) -> None:
    # Events carry only the parent's 64-bit tail, so the parent digest must come
    # from blocks hashed earlier in the stream, exactly as a consumer would do it.
    digest_of: dict[int, bytes] = {}
    stored = 0
    for frame in vllm_events["frames_decoded"]:
        for ev in frame["events"]:
            if ev["type"] != "BlockStored":
                continue
            parent_u64 = ev["parent_block_hash"]
            parent = None if parent_u64 is None else digest_of[parent_u64]
            n = len(ev["block_hashes"])
            assert len(ev["token_ids"]) == n * ev["block_size"]
            assert ev["extra_keys"] == [None] * n
            digests = vllm_sha256_cbor_digests(
                ev["token_ids"], ev["block_size"], parent=parent, none_hash_seed=VLLM_SEED
            )
            assert [vllm_block_hash_from_digest(d) for d in digests] == ev["block_hashes"]
            digest_of.update(zip(ev["block_hashes"], digests, strict=True))
            stored += n
    assert stored == vllm_events["counts"]["stored_blocks"] == 147


def test_vllm_example_preimage(vllm_events: dict[str, Any]) -> None:
    ex = vllm_events["hash_check"]["example_first_block"]
    none = vllm_none_hash(VLLM_SEED)
    assert none.hex() == ex["parent_digest_hex"]
    pre = vllm_block_preimage(none, ex["token_ids"], ex["extra_keys"])
    assert pre.hex() == ex["cbor_preimage_hex"]
    assert hashlib.sha256(pre).hexdigest() == ex["sha256_hex"]
    assert vllm_sha256_cbor_chain(ex["token_ids"], 32, none_hash_seed=VLLM_SEED) == [ex["block_hash_u64"]]


def test_vllm_seed_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    toks = list(range(64))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert vllm_none_hash_seed() == VLLM_SEED
    default = vllm_sha256_cbor_chain(toks, 16)
    assert default == vllm_sha256_cbor_chain(toks, 16, none_hash_seed=VLLM_SEED)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_none_hash_seed() == "0"
    seeded = vllm_sha256_cbor_chain(toks, 16)
    assert seeded == vllm_sha256_cbor_chain(toks, 16, none_hash_seed="0")
    assert all(a != b for a, b in zip(default, seeded, strict=True))


def test_vllm_parent_forms() -> None:
    toks = list(range(1000, 1160))
    digests = vllm_sha256_cbor_digests(toks, 16, none_hash_seed=VLLM_SEED)
    full = vllm_sha256_cbor_chain(toks, 16, none_hash_seed=VLLM_SEED)
    for k in (1, 4, 9):
        tail = toks[16 * k :]
        assert vllm_sha256_cbor_chain(tail, 16, parent=digests[k - 1]) == full[k:]
        as_int = int.from_bytes(digests[k - 1], "big")
        assert vllm_sha256_cbor_chain(tail, 16, parent=as_int) == full[k:]
    # An empty parent is falsy, which vLLM replaces with NONE_HASH.
    assert vllm_sha256_cbor_chain(toks, 16, parent=b"", none_hash_seed=VLLM_SEED) == full
    with pytest.raises(ValueError, match="64-bit"):
        vllm_sha256_cbor_chain(toks, 16, parent=full[0])
    with pytest.raises(ValueError, match="32-byte"):
        vllm_sha256_cbor_chain(toks, 16, parent=b"\x01" * 8)


def test_vllm_extra_keys() -> None:
    toks = list(range(64))
    plain = vllm_sha256_cbor_chain(toks, 16, none_hash_seed=VLLM_SEED)
    assert vllm_sha256_cbor_chain(toks, 16, none_hash_seed=VLLM_SEED, extra_keys=[None] * 4) == plain
    salted = [(("cache_salt", "s1"),), None, None, None]
    got = vllm_sha256_cbor_chain(toks, 16, none_hash_seed=VLLM_SEED, extra_keys=salted)
    # A salt on block 0 changes every later hash through the chain.
    assert all(a != b for a, b in zip(plain, got, strict=True))
    expect0 = hashlib.sha256(vllm_block_preimage(vllm_none_hash(VLLM_SEED), toks[:16], salted[0])).digest()
    assert got[0] == vllm_block_hash_from_digest(expect0)
    with pytest.raises(ValueError, match="extra_keys"):
        vllm_sha256_cbor_chain(toks, 16, extra_keys=[None] * 3)


VECTORS = Path(__file__).resolve().parent / "data" / "vllm_hash_vectors.json"


@pytest.mark.parametrize("case", json.loads(VECTORS.read_text()), ids=lambda c: f"{c['algo']}-{c['seed']}-"
                         f"{'extra' if c['extra_keys'] else 'plain'}")
def test_vllm_reference_matches_vllms_own_functions(case: dict[str, Any]) -> None:
    # Vectors from vLLM's hash_block_tokens / init_none_hash (tests/make_hash_vectors.py).
    toks, bs, algo, seed = case["token_ids"], case["block_size"], case["algo"], case["seed"]
    assert vllm_none_hash(seed, algo).hex() == case["none_hash_hex"]
    digests = vllm_digests(toks, bs, algo=algo, none_hash_seed=seed, extra_keys=case["extra_keys"])
    assert [d.hex() for d in digests] == case["digests_hex"]
    assert vllm_chain(toks, bs, algo=algo, none_hash_seed=seed, extra_keys=case["extra_keys"]) == case["event_hashes"]
    # Continuing from a parent digest gives the rest of the chain.
    rest = None if case["extra_keys"] is None else case["extra_keys"][2:]
    assert vllm_chain(toks[2 * bs :], bs, algo=algo, parent=digests[1], extra_keys=rest) == case["event_hashes"][2:]


def test_vectors_cover_every_algo_with_and_without_extra_keys() -> None:
    cases = json.loads(VECTORS.read_text())
    assert {(c["algo"], bool(c["extra_keys"])) for c in cases} == {(a, e) for a in VLLM_HASH_ALGOS for e in (0, 1)}
    # Different extra keys (another LoRA adapter, a salt) never share a block hash with the plain chain.
    plain = {c["algo"]: c["event_hashes"] for c in cases if not c["extra_keys"] and c["seed"] == "0"}
    for c in cases:
        if c["extra_keys"] and c["seed"] == "0":
            assert all(a != b for a, b in zip(plain[c["algo"]], c["event_hashes"], strict=True))


def test_vllm_xxhash_needs_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="random"):
        vllm_chain(list(range(32)), 16, algo="xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    assert vllm_chain(list(range(32)), 16, algo="xxhash") == vllm_chain(
        list(range(32)), 16, algo="xxhash", none_hash_seed="5"
    )
    with pytest.raises(ValueError, match="unknown vLLM hash algo"):
        vllm_chain(list(range(32)), 16, algo="md5")


# --------------------------------------------------------------------------- LMCache fixture

_LMCACHE_CASE_KIND = {
    # (vLLM importable, algorithm) -> lmcache_root kind and chain algo
    (False, "builtin"): ("zero", "builtin"),
    (True, "builtin"): ("vllm_builtin", "builtin"),
    (True, "sha256_cbor"): ("vllm_sha256_cbor", "sha256_cbor"),
}


def test_lmcache_every_case(lmcache_chunks: dict[str, Any]) -> None:
    chunk = lmcache_chunks["chunk_size"]
    params = lmcache_chunks["cache_engine_key_params"]
    checked = 0
    for case in lmcache_chunks["cases"].values():
        kind, algo = _LMCACHE_CASE_KIND[(case["vllm_importable"], case["pre_caching_hash_algorithm"])]
        root = lmcache_root(kind, seed=case.get("NONE_HASH_seed_string", case["PYTHONHASHSEED"]))
        assert root == case["NONE_HASH"]
        if "NONE_HASH_digest_hex" in case:
            assert vllm_none_hash(case["NONE_HASH_seed_string"]).hex() == case["NONE_HASH_digest_hex"]
        for name, expected in case["results"].items():
            toks = lmcache_chunks["token_lists"][name]
            got = lmcache_chunk_chain(toks, chunk, root=root, algo=algo)
            assert got == expected["chunk_hashes"]
            assert [f"{h:x}" for h in got] == expected["chunk_hashes_hex"]
            spans = [[i * chunk, (i + 1) * chunk] for i in range(len(got))]
            assert spans == expected["spans"]
            prefix = f"{params['model_name']}@{params['world_size']}@{params['worker_id']}"
            keys = [f"{prefix}@{h:x}@{params['dtype']}" for h in got]
            assert keys == expected["all_chunk_keys"]
            assert keys[0] == expected["first_chunk_key"]
            assert lmcache_chunk_chain(np.asarray(toks), chunk, root=root, algo=algo) == got
            checked += len(got)
    assert checked == 3 * (2 + 4 + 4)


def test_lmcache_shared_prefix(lmcache_chunks: dict[str, Any]) -> None:
    toks = lmcache_chunks["token_lists"]
    a = lmcache_chunk_chain(toks["tokens_1024"], root=0)
    b = lmcache_chunk_chain(toks["tokens_1024_shared512"], root=0)
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]


def test_lmcache_root_errors() -> None:
    with pytest.raises(ValueError, match="random"):
        lmcache_root("vllm_builtin", seed=VLLM_SEED)
    with pytest.raises(ValueError, match="unknown"):
        lmcache_root("blake3")
    with pytest.raises(ValueError, match="algo"):
        lmcache_chunk_chain(list(range(256)), algo="blake3")  # type: ignore[arg-type]
    assert lmcache_root("zero", seed="anything") == 0


_STR_SAMPLES = ["0", "1", "vllm-none-hash", "é-latin1", "€ two-byte", "😀 four-byte", "x" * 23, "12345678"]


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_python_str_hash_matches_cpython(seed: int) -> None:
    code = "import json,sys; print(json.dumps([hash(s) for s in json.loads(sys.argv[1])]))"
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(_STR_SAMPLES)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert [python_str_hash(s, seed) for s in _STR_SAMPLES] == json.loads(out)
    assert python_str_hash("", seed) == 0


# --------------------------------------------------------------------------- fast chain


def _fast_reference(tokens: list[int], block_size: int, root: int) -> list[int]:
    # Written from the module docstring's definition, sharing no code with it.
    out, h = [], root
    for j in range(len(tokens) // block_size):
        blk = struct.pack(f"<{block_size}I", *tokens[j * block_size : (j + 1) * block_size])
        h = xxhash.xxh3_64(blk, seed=h).intdigest()
        out.append(h)
    return out


def test_fast_root_definition() -> None:
    expect = xxhash.xxh3_64(b"smetric-lmc/fast/v1\x00" + "qwen/lörä".encode(), seed=0).intdigest()
    assert fast_root("qwen/lörä") == expect
    assert fast_root("") == FAST_ROOT
    assert fast_root("a") != fast_root("b")


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=300)
block_sizes = st.sampled_from([1, 2, 3, 16, 32, 64])
roots = st.integers(0, 2**64 - 1)


@settings(max_examples=150, deadline=None)
@given(token_lists, block_sizes, roots)
def test_fast_matches_reference(tokens: list[int], bs: int, root: int) -> None:
    expect = _fast_reference(tokens, bs, root)
    assert fast_chain(tokens, bs, root=root) == expect
    assert fast_chain(np.asarray(tokens, dtype=np.uint32), bs, root=root) == expect
    assert fast_chain(np.asarray(tokens, dtype=np.int64), bs, root=root) == expect
    assert fast_chain(tuple(tokens), bs, root=root) == expect
    assert fast_chain_from_bytes(token_bytes(tokens), bs, root=root) == expect


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=200), block_sizes)
def test_fast_numpy_dtypes_and_views(tokens: list[int], bs: int) -> None:
    expect = fast_chain(tokens, bs)
    wide = np.asarray(tokens + tokens, dtype=np.int32)
    assert fast_chain(wide[: len(tokens)], bs) == expect
    strided = np.repeat(np.asarray(tokens, dtype=np.uint64), 2)[::2]
    assert fast_chain(strided, bs) == expect
    assert fast_chain(np.asarray(tokens, dtype=">u4"), bs) == expect


def test_fast_rejects_bad_input() -> None:
    for bad in ([1, -1], [2**32]):
        with pytest.raises(ValueError, match="2\\*\\*32"):
            fast_chain(bad, 1)
        with pytest.raises(ValueError, match="2\\*\\*32"):
            fast_chain(np.asarray(bad, dtype=np.int64), 1)
    with pytest.raises(ValueError, match="one-dimensional"):
        fast_chain(np.zeros((2, 16), dtype=np.uint32), 16)
    with pytest.raises(ValueError, match="integer dtype"):
        fast_chain(np.zeros(16, dtype=np.float32), 16)
    with pytest.raises(ValueError, match="block_size"):
        fast_chain([1, 2, 3], 0)
    with pytest.raises(ValueError, match="multiple of 4"):
        fast_chain_from_bytes(b"\x00" * 6, 1)


# --------------------------------------------------------------------------- all schemes

_SCHEME_ROOTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fast": ({"root": fast_root("m1")}, {"root": fast_root("m2")}),
    "vllm_sha256_cbor": ({"none_hash_seed": VLLM_SEED}, {"none_hash_seed": "0"}),
    "lmcache_builtin": ({"root": 0}, {"root": 5313149338359954478}),
    "lmcache_sha256_cbor": ({"root": 0}, {"root": 5625442194607170974}),
    "vllm_sha256": ({"none_hash_seed": VLLM_SEED}, {"none_hash_seed": "0"}),
    "vllm_xxhash": ({"none_hash_seed": "1"}, {"none_hash_seed": "2"}),
    "vllm_xxhash_cbor": ({"none_hash_seed": "1"}, {"none_hash_seed": "2"}),
}


def chain(scheme: str, token_ids: Any, block_size: int, **kw: Any) -> list[int]:
    if scheme == "fast":
        return fast_chain(token_ids, block_size, **kw)
    if scheme.startswith("lmcache_"):
        return lmcache_chunk_chain(token_ids, block_size, algo=scheme.removeprefix("lmcache_"), **kw)  # type: ignore[arg-type]
    return vllm_chain(token_ids, block_size, algo=scheme.removeprefix("vllm_"), **kw)


SCHEMES = tuple(_SCHEME_ROOTS)


@pytest.mark.parametrize("scheme", SCHEMES)
@settings(max_examples=40, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 150_000), max_size=260),
    bs=st.sampled_from([4, 16, 32]),
    cut=st.integers(0, 260),
)
def test_chain_properties(scheme: str, tokens: list[int], bs: int, cut: int) -> None:
    kw_a, kw_b = _SCHEME_ROOTS[scheme]
    full = chain(scheme, tokens, bs, **kw_a)
    assert len(full) == len(tokens) // bs
    # Hashes of a prefix are a prefix of the hashes; the partial tail is ignored.
    assert chain(scheme, tokens[:cut], bs, **kw_a) == full[: min(cut, len(tokens)) // bs]
    assert chain(scheme, tokens[: len(full) * bs], bs, **kw_a) == full
    assert chain(scheme, np.asarray(tokens, dtype=np.int64), bs, **kw_a) == full
    other = chain(scheme, tokens, bs, **kw_b)
    assert all(a != b for a, b in zip(full, other, strict=True))
    if full:
        # Changing one token changes its block's hash and every one after it.
        changed = list(tokens)
        changed[0] += 1
        assert all(a != b for a, b in zip(full, chain(scheme, changed, bs, **kw_a), strict=True))


@settings(max_examples=60, deadline=None)
@given(token_lists, block_sizes, st.integers(1, 10))
def test_fast_chain_continues_from_parent(tokens: list[int], bs: int, k: int) -> None:
    full = fast_chain(tokens, bs)
    if len(full) < k:
        return
    assert fast_chain(tokens[k * bs :], bs, root=full[k - 1]) == full[k:]


def test_lmcache_builtin_uses_interpreter_hash() -> None:
    toks = list(range(512))
    h0 = hash((0, tuple(toks[:256]), ()))
    assert lmcache_chunk_chain(toks, root=0) == [h0, hash((h0, tuple(toks[256:]), ()))]


def test_module_exports_exist() -> None:
    for name in hashing.__all__:
        assert hasattr(hashing, name), name
