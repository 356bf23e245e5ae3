"""vLLM 0.32's prefix-caching block hashes, reimplemented for tests.

The controller never computes vLLM's hashes (it re-hashes token ids into its own chain), so this
lives with the tests: they use it to stand in for engines with other ``--prefix-caching-hash-algo``
settings or extra keys. ``tests/test_hashing.py`` checks it against vectors vLLM's own
``hash_block_tokens`` produced (``tests/data/vllm_hash_vectors.json``, written by
``tests/make_hash_vectors.py`` in the engine venv) and against recorded KV event frames.

``d_j = H((d_{j-1}, tuple(block_j), extra_keys_j))``: ``H`` serialises with canonical CBOR
(``*_cbor``) or pickle protocol 5, then hashes with SHA-256 (32 bytes) or XXH3-128 (16 bytes);
``d_{-1} = NONE_HASH = H(seed)``, seed = PYTHONHASHSEED if set else ``"vllm-none-hash"``. KV
events report the last 8 bytes of ``d_j`` big-endian.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import cbor2
import xxhash

from smetric_lmc.hashing import TokenIds, vllm_none_hash_seed

_U64 = (1 << 64) - 1


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _as_int_list(token_ids: TokenIds) -> list[int]:
    return token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)


VLLM_HASH_ALGOS: tuple[str, ...] = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
# vLLM pickles with HIGHEST_PROTOCOL, which is 5 on every Python it supports.
_PICKLE_PROTOCOL = 5


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _xxh128_pickle(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def _xxh128_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


_VLLM_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
    "xxhash": _xxh128_pickle,
    "xxhash_cbor": _xxh128_cbor,
}
_VLLM_DIGEST_SIZE = {"sha256_cbor": 32, "sha256": 32, "xxhash": 16, "xxhash_cbor": 16}


def _vllm_hash_fn(algo: str) -> Callable[[Any], bytes]:
    try:
        return _VLLM_HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unknown vLLM hash algo {algo!r}; expected one of {VLLM_HASH_ALGOS}") from None


def vllm_none_hash(seed: str | None = None, algo: str = "sha256_cbor") -> bytes:
    """NONE_HASH, the parent digest of every first block.

    ``seed`` None resolves it as vLLM does (:func:`vllm_none_hash_seed`).
    """
    return _none_hash_for(vllm_none_hash_seed(algo) if seed is None else seed, algo)


@lru_cache(maxsize=64)
def _none_hash_for(seed: str, algo: str) -> bytes:
    return _vllm_hash_fn(algo)(seed)


def vllm_block_preimage(
    parent_digest: bytes, block_token_ids: Sequence[int], extra_keys: Any = None
) -> bytes:
    """Canonical CBOR bytes vLLM's sha256_cbor hashes for one block."""
    return cbor2.dumps((parent_digest, tuple(block_token_ids), _freeze(extra_keys)), canonical=True)


def vllm_block_hash_from_digest(digest: bytes) -> int:
    """The unsigned 64-bit hash vLLM KV events report for a block digest."""
    return int.from_bytes(digest[-8:], "big")


def _freeze(keys: Any) -> Any:
    # vLLM builds extra keys from tuples; pickle tells a list from a tuple, so
    # lists (e.g. decoded from JSON or msgpack) must become tuples again.
    if isinstance(keys, (list, tuple)):
        return tuple(_freeze(k) for k in keys)
    return keys


def _vllm_parent_digest(parent: int | bytes | None, none_hash_seed: str | None, algo: str) -> bytes:
    # vLLM substitutes NONE_HASH for any falsy parent, including b"".
    if not parent:
        return vllm_none_hash(none_hash_seed, algo)
    size = _VLLM_DIGEST_SIZE[algo]
    if isinstance(parent, int):
        # A 64-bit event hash has lost the rest of the digest; taking it for
        # one would silently produce a chain no engine ever computes.
        if parent <= _U64 or parent >> (8 * size):
            raise ValueError(
                f"parent int must be the full {8 * size}-bit digest (int.from_bytes(digest, 'big')); "
                "the 64-bit hash in KV events cannot continue a vLLM chain"
            )
        return parent.to_bytes(size, "big")
    if isinstance(parent, (bytes, bytearray, memoryview)) and len(parent) == size:
        return bytes(parent)
    raise ValueError(
        f"parent must be None or a {size}-byte {algo} digest, "
        f"got {type(parent).__name__} of length {len(parent)}"
    )


def vllm_digests(
    token_ids: TokenIds,
    block_size: int,
    *,
    algo: str = "sha256_cbor",
    parent: int | bytes | None = None,
    none_hash_seed: str | None = None,
    extra_keys: Sequence[Any] | None = None,
) -> list[bytes]:
    """Full block digests of vLLM 0.32's chain for ``--prefix-caching-hash-algo algo``.

    ``d_j = H((d_{j-1}, tuple(block_j), extra_keys_j))`` where ``H`` serialises
    with canonical CBOR (``*_cbor``) or pickle protocol 5, then hashes with
    SHA-256 (32 bytes) or XXH3-128 (16 bytes).

    ``parent``: digest of the block before ``token_ids`` (bytes, or the same
    bytes as a big-endian int); None starts at NONE_HASH for ``none_hash_seed``
    (None: resolve as vLLM does, see :func:`vllm_none_hash_seed`).
    ``extra_keys``: one entry per full block, each the hash-input keys vLLM's
    ``generate_block_hash_extra_keys`` builds (tagged tuples such as
    ``("lora", name, path)`` or ``("cache_salt", salt)``) or None. KV events
    publish an untagged form of these keys, which does not hash the same.
    """
    _check_block_size(block_size)
    hash_fn = _vllm_hash_fn(algo)
    toks = _as_int_list(token_ids)
    n_blocks = len(toks) // block_size
    if extra_keys is not None and len(extra_keys) != n_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks")
    prev = _vllm_parent_digest(parent, none_hash_seed, algo)
    out: list[bytes] = []
    for j in range(n_blocks):
        start = j * block_size
        extra = None if extra_keys is None else _freeze(extra_keys[j])
        prev = hash_fn((prev, tuple(toks[start : start + block_size]), extra))
        out.append(prev)
    return out


def vllm_chain(token_ids: TokenIds, block_size: int, **kw: Any) -> list[int]:
    """Block hashes exactly as vLLM 0.32 KV events report them (last 8 bytes, big-endian, of each
    digest). Arguments as in :func:`vllm_digests`."""
    return [vllm_block_hash_from_digest(d) for d in vllm_digests(token_ids, block_size, **kw)]


def vllm_sha256_cbor_digests(token_ids: TokenIds, block_size: int, **kw: Any) -> list[bytes]:
    """32-byte digests of vLLM's sha256_cbor chain (see :func:`vllm_digests`)."""
    return vllm_digests(token_ids, block_size, algo="sha256_cbor", **kw)


def vllm_sha256_cbor_chain(token_ids: TokenIds, block_size: int, **kw: Any) -> list[int]:
    """Event block hashes under sha256_cbor (see :func:`vllm_digests`)."""
    return vllm_chain(token_ids, block_size, algo="sha256_cbor", **kw)
