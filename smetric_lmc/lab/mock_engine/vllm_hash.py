"""The block hashes a vLLM 0.32 engine with ``--prefix-caching-hash-algo sha256_cbor`` computes, so
that the mock engine's KV events carry the hashes a real engine would send for the same tokens.

Digest of block j: SHA-256 of canonical CBOR ``[digest of block j-1, [tokens], null]``; block 0
continues NONE_HASH, the SHA-256 of the CBOR seed string (PYTHONHASHSEED, else "vllm-none-hash").
Events carry each digest's last 8 bytes, big-endian. (The test suite's own reimplementation checks
every algorithm against vectors from vLLM; the mock serves only the one the project's engines use.)
"""

from __future__ import annotations

from collections.abc import Sequence

from smetric_lmc.hashing import _sha256_cbor, vllm_none_hash_seed

SUPPORTED_ALGOS = ("sha256_cbor",)


def chain_digests(tokens: Sequence[int], block_size: int, parent: bytes | None, none_hash_seed: str | None) -> list[bytes]:
    """Digests of the full blocks of ``tokens``, continuing ``parent`` (None: the chain's start)."""
    prev = parent if parent is not None else _sha256_cbor(none_hash_seed or vllm_none_hash_seed("sha256_cbor"))
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = _sha256_cbor((prev, tuple(tokens[start : start + block_size]), None))
        out.append(prev)
    return out


def event_hash(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")
