"""Prefix-chained block hashes for every hash space the controller meets.

All chains map token ids to one 64-bit int per *full* block; a trailing partial
block is never hashed. Hash ``j`` depends on blocks ``0..j``, so the hashes of a
prefix are a prefix of the hashes.

Schemes
-------
``fast`` -- the controller's own index key (portable definition)::

    bytes(tokens)  = each token id as uint32, little-endian, 4 bytes per token
    block_j        = bytes(tokens)[4*B*j : 4*B*(j+1)]    for every full block
    h_{-1}         = root                                 (unsigned 64-bit)
    h_j            = XXH3_64bits_withSeed(block_j, 4*B, seed=h_{j-1})
    fast_root(ns)  = XXH3_64bits_withSeed(b"smetric-lmc/fast/v1\\x00" + utf8(ns), seed=0)
    FAST_ROOT      = fast_root("")

  Token ids must lie in [0, 2**32). A gateway in any language with an XXH3
  binding reproduces this bit for bit. Namespacing the root (model, LoRA name)
  keeps equal token prefixes of different models apart in one index.

vLLM's own block hashes (``--prefix-caching-hash-algo``) are never recomputed here: the index
re-hashes every ``BlockStored``'s token ids into the fast chain and keeps vLLM's hashes only as
aliases for later ``BlockRemoved`` events.

``lmcache_builtin`` / ``lmcache_sha256_cbor`` -- LMCache 0.5.6
  ``ChunkedTokenDatabase`` chunk hashes (256-token chunks by default):
  ``h_i = hash((h_{i-1}, tuple(chunk), ()))`` with CPython's built-in ``hash``
  (signed 64-bit), or the *first* 8 bytes big-endian of
  ``sha256(canonical CBOR [h_{i-1}, [tokens], []])``. The root ``h_{-1}`` is
  LMCache's NONE_HASH, see :func:`lmcache_root`.

:class:`HashSettings` is the one description of how a prompt becomes these chains in a deployment;
the controller builds it from its config and publishes it in ``stats``, gateways and clients adopt it.
"""

from __future__ import annotations

import array
import hashlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import cbor2
import numpy as np
import xxhash

if TYPE_CHECKING:
    from smetric_lmc.config import Config, HashingConfig
    from smetric_lmc.wire import HashChain

__all__ = [
    "FAST_ROOT",
    "LMCACHE_ROOT_KINDS",
    "VLLM_DEFAULT_NONE_HASH_SEED",
    "HashSettings",
    "TokenIds",
    "fast_chain",
    "fast_chain_from_bytes",
    "fast_root",
    "lmcache_chunk_chain",
    "lmcache_root",
    "python_str_hash",
    "token_bytes",
    "vllm_none_hash_seed",
]

TokenIds: TypeAlias = Sequence[int] | np.ndarray

_U64 = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1

# ---------------------------------------------------------------------------
# fast chain (the controller's own index key)
# ---------------------------------------------------------------------------

_FAST_DOMAIN = b"smetric-lmc/fast/v1\x00"
_xxh3_64 = xxhash.xxh3_64_intdigest


def fast_root(namespace: str) -> int:
    """Chain root for ``namespace`` (e.g. model name, or ``model/lora``)."""
    return _xxh3_64(_FAST_DOMAIN + namespace.encode("utf-8"), 0)


FAST_ROOT: int = fast_root("")


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as the little-endian uint32 byte string the fast chain hashes.

    Raises ValueError for ids outside [0, 2**32).
    """
    if isinstance(token_ids, np.ndarray):
        return _ndarray_le_u32(token_ids).tobytes()
    return _list_le_u32(token_ids).tobytes()


# The array typecode whose items are 4 bytes on this ABI ("I" everywhere common).
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)


def _list_le_u32(token_ids: Sequence[int]) -> array.array:
    # array('I') converts a list in C, about twice as fast as np.array(list).
    try:
        buf = array.array(_U32_CODE, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":  # pragma: no cover - x86/arm hosts are little-endian
        buf.byteswap()
    return buf


def _ndarray_le_u32(arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.dtype("<u4"):
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must have an integer dtype, got {arr.dtype}")
    # astype wraps silently, so out-of-range ids must be caught first.
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4")


def fast_chain_from_bytes(
    data: bytes | bytearray | memoryview, block_size: int, *, root: int = FAST_ROOT
) -> list[int]:
    """Fast chain over token ids already encoded by :func:`token_bytes`."""
    _check_block_size(block_size)
    nbytes = len(data) if not isinstance(data, memoryview) else data.nbytes
    if nbytes % 4:
        raise ValueError(f"token byte string length {nbytes} is not a multiple of 4")
    return _chain_blocks(data, block_size, nbytes // (4 * block_size), root)


_BLOCK_DTYPES: dict[int, np.dtype] = {}


def _chain_blocks(buf: Any, block_size: int, n_blocks: int, root: int) -> list[int]:
    """Chain over the first ``n_blocks`` full blocks of little-endian u32 token ids in ``buf``."""
    if n_blocks <= 0:
        return []
    dtype = _BLOCK_DTYPES.get(block_size)
    if dtype is None:  # parsing "V64" costs more than hashing a block: one dtype per block size
        dtype = _BLOCK_DTYPES[block_size] = np.dtype(f"V{4 * block_size}")
    # Viewing the buffer as fixed-size void records makes numpy cut all block
    # byte strings in one C call; what stays in Python is one hash call per
    # block, and a comprehension is cheaper than an explicit append loop.
    blocks = np.frombuffer(buf, dtype=dtype, count=n_blocks).tolist()
    h = root & _U64
    f = _xxh3_64
    return [h := f(blk, h) for blk in blocks]


def fast_chain(token_ids: TokenIds, block_size: int, *, root: int = FAST_ROOT) -> list[int]:
    """The controller's chained block hashes (definition in the module docstring).

    ``root`` is the seed of the first block (taken modulo 2**64):
    :data:`FAST_ROOT`, a :func:`fast_root` namespace, or the hash of the block
    preceding ``token_ids`` when continuing a chain.
    """
    _check_block_size(block_size)
    if isinstance(token_ids, np.ndarray):
        buf: Any = _ndarray_le_u32(token_ids)
    else:
        buf = _list_le_u32(token_ids)
    return _chain_blocks(buf, block_size, len(buf) // block_size, root)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _as_int_list(token_ids: TokenIds) -> list[int]:
    # cbor2 cannot encode numpy scalars, so numpy input becomes plain ints.
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise ValueError(
                f"token ids must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}"
            )
        return token_ids.tolist()
    return token_ids if isinstance(token_ids, list) else list(token_ids)


# ---------------------------------------------------------------------------
# vLLM 0.32 prefix-caching block hashes
# ---------------------------------------------------------------------------

VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_none_hash_seed(algo: str = "sha256_cbor") -> str:
    """The seed vLLM 0.32 derives NONE_HASH from: PYTHONHASHSEED, else
    ``"vllm-none-hash"`` for the sha256 algorithms.

    Reads *this* process's environment; a controller for remote engines should
    pass the engines' seed explicitly instead. Raises ValueError for the xxhash
    algorithms without PYTHONHASHSEED, whose seed vLLM then draws at random.
    """
    if algo not in ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor"):
        raise ValueError(f"unknown vLLM hash algo {algo!r}")
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo.startswith("xxhash"):
        raise ValueError(
            f"vLLM's {algo} NONE_HASH is random per process unless PYTHONHASHSEED is set; "
            "pass the engines' none_hash_seed"
        )
    return VLLM_DEFAULT_NONE_HASH_SEED


# ---------------------------------------------------------------------------
# LMCache 0.5.6 ChunkedTokenDatabase
# ---------------------------------------------------------------------------

LMCACHE_ROOT_KINDS = ("zero", "vllm_builtin", "vllm_sha256_cbor")


def _rotl64(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _U64


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573

    def rnd() -> None:
        nonlocal v0, v1, v2, v3
        v0 = (v0 + v1) & _U64
        v2 = (v2 + v3) & _U64
        v1 = _rotl64(v1, 13) ^ v0
        v3 = _rotl64(v3, 16) ^ v2
        v0 = _rotl64(v0, 32)
        v2 = (v2 + v1) & _U64
        v0 = (v0 + v3) & _U64
        v1 = _rotl64(v1, 17) ^ v2
        v3 = _rotl64(v3, 21) ^ v0
        v2 = _rotl64(v2, 32)

    n = len(data)
    tail_at = n - n % 8
    for i in range(0, tail_at, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v3 ^= m
        rnd()
        v0 ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(data[tail_at:], "little")
    v3 ^= b
    rnd()
    v0 ^= b
    v2 ^= 0xFF
    rnd()
    rnd()
    rnd()
    return v0 ^ v1 ^ v2 ^ v3


def python_str_hash(s: str, pythonhashseed: int) -> int:
    """``hash(s)`` as CPython 3.11+ (64-bit, siphash13) computes it under
    ``PYTHONHASHSEED=pythonhashseed``, independent of this process's seed.

    LMCache with vLLM importable roots its builtin chain at ``hash(seed)``, so
    a controller must reproduce the engine's string hash, not its own.
    """
    if not 0 <= pythonhashseed <= _U32_MAX:
        raise ValueError(f"PYTHONHASHSEED must lie in [0, 2**32), got {pythonhashseed}")
    if not s:
        return 0
    if pythonhashseed == 0:
        secret = bytes(16)  # seed 0 disables randomisation: an all-zero key
    else:
        # CPython's lcg_urandom key derivation (Python/bootstrap_hash.c).
        x = pythonhashseed
        key = bytearray(16)
        for i in range(16):
            x = (x * 214013 + 2531011) & 0xFFFFFFFF
            key[i] = (x >> 16) & 0xFF
        secret = bytes(key)
    # CPython hashes the string's compact storage: 1, 2 or 4 bytes per char.
    widest = max(map(ord, s))
    if widest < 0x100:
        data = s.encode("latin-1")
    elif widest < 0x10000:
        data = s.encode("utf-16-le")
    else:
        data = s.encode("utf-32-le")
    k0 = int.from_bytes(secret[:8], "little")
    k1 = int.from_bytes(secret[8:16], "little")
    h = _siphash13(k0, k1, data)
    h = h - (1 << 64) if h >> 63 else h
    return -2 if h == -1 else h


def lmcache_root_of(h: HashingConfig) -> int:
    """The configured ``hashing.lmcache_root`` as the int the chunk chain starts from."""
    if isinstance(h.lmcache_root, int):
        return h.lmcache_root
    return lmcache_root(h.lmcache_root, seed=h.lmcache_root_seed)


def lmcache_root(kind: str, *, seed: str | None = None) -> int:
    """LMCache 0.5.6's NONE_HASH, the root of its chunk chain.

    ``kind``:
      - ``"zero"``: vLLM not importable by LMCache (also its sha256_cbor
        fallback) -> 0;
      - ``"vllm_builtin"``: vLLM importable, builtin hash -> ``hash(seed)``
        under the engine's PYTHONHASHSEED;
      - ``"vllm_sha256_cbor"``: vLLM importable, sha256_cbor -> first 8 bytes
        big-endian of ``sha256(CBOR seed)``.
    ``seed``: vLLM's NONE_HASH seed string, i.e. the engine's PYTHONHASHSEED or
    ``"vllm-none-hash"`` when unset; None resolves it from this process's
    environment.
    """
    if kind == "zero":
        return 0
    if seed is None:
        seed = vllm_none_hash_seed()
    if kind == "vllm_sha256_cbor":
        return int.from_bytes(_sha256_cbor(seed)[:8], "big")
    if kind == "vllm_builtin":
        # The seed string is PYTHONHASHSEED itself unless that was unset, in
        # which case the engine's string hash was randomised per process.
        if not (seed.isascii() and seed.isdigit()) or int(seed) > _U32_MAX:
            raise ValueError(
                f"root 'vllm_builtin' with seed {seed!r} depends on a random per-process "
                "PYTHONHASHSEED and cannot be reproduced; run the engines with PYTHONHASHSEED set"
            )
        return python_str_hash(seed, int(seed))
    raise ValueError(f"unknown LMCache root kind {kind!r}; expected one of {LMCACHE_ROOT_KINDS}")


def lmcache_chunk_chain(
    token_ids: TokenIds,
    chunk_size: int = 256,
    *,
    root: int = 0,
    algo: Literal["builtin", "sha256_cbor"] = "builtin",
) -> list[int]:
    """Chunk hashes of LMCache 0.5.6 ``ChunkedTokenDatabase`` (full chunks only).

    ``builtin`` uses this interpreter's ``hash`` of ``(prev, tuple(chunk), ())``;
    a tuple of ints hashes the same in every 64-bit CPython regardless of
    PYTHONHASHSEED, so only ``root`` carries the engine's seed.
    """
    _check_block_size(chunk_size)
    toks = _as_int_list(token_ids)
    n_chunks = len(toks) // chunk_size
    prev = root
    out: list[int] = []
    if algo == "builtin":
        if sys.hash_info.width != 64:  # pragma: no cover - 32-bit interpreters only
            raise RuntimeError("LMCache builtin chunk hashes need a 64-bit CPython")
        for i in range(n_chunks):
            start = i * chunk_size
            prev = hash((prev, tuple(toks[start : start + chunk_size]), ()))
            out.append(prev)
    elif algo == "sha256_cbor":
        for i in range(n_chunks):
            start = i * chunk_size
            digest = _sha256_cbor((prev, toks[start : start + chunk_size], ()))
            prev = int.from_bytes(digest[:8], "big")
            out.append(prev)
    else:
        raise ValueError(f"unknown LMCache hash algo {algo!r}; expected 'builtin' or 'sha256_cbor'")
    return out


# ---------------------------------------------------------------------------
# one deployment's settings
# ---------------------------------------------------------------------------

LMCacheAlgo = Literal["builtin", "sha256_cbor"]


@dataclass(frozen=True, slots=True)
class HashSettings:
    """How prompts become the index's hash chains in one deployment.

    Built once from the controller's config (:meth:`from_config`); the controller publishes it in
    its ``stats`` reply (:meth:`as_stats`) and gateways adopt it from there (:meth:`from_stats`),
    so client-side hashes always match the index. Every root is resolved to an int here.
    """

    block_size: int = 16
    fast_root: int = FAST_ROOT
    chunk_size: int = 256
    lmcache_algo: LMCacheAlgo = "builtin"
    lmcache_root: int = 0
    want_chunks: bool = False  # LMCache local tier or a global tier is indexed

    @classmethod
    def from_config(cls, cfg: Config) -> HashSettings:
        h = cfg.hashing
        return cls(
            block_size=h.block_size,
            fast_root=fast_root(h.fast_namespace),
            chunk_size=h.lmcache_chunk_size,
            lmcache_algo=h.lmcache_hash,
            lmcache_root=lmcache_root_of(h),
            want_chunks=cfg.lmcache.enabled or cfg.global_store.kind != "none",
        )

    @property
    def lmcache_scheme(self) -> str:
        return f"lmcache_{self.lmcache_algo}"

    def as_stats(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "fast_root": self.fast_root,
            "lmcache_hash": self.lmcache_algo,
            "lmcache_scheme": self.lmcache_scheme,
            "lmcache_chunk_size": self.chunk_size,
            "lmcache_root": self.lmcache_root,
            "chunks_indexed": self.want_chunks,
        }

    @classmethod
    def from_stats(cls, d: Any) -> HashSettings:
        """The settings a controller's ``stats()["hashing"]`` describes; ValueError if incomplete."""
        if not isinstance(d, dict):
            raise ValueError(f"stats hashing: expected a mapping, got {type(d).__name__}")
        want = {"block_size": int, "fast_root": int, "lmcache_hash": str, "lmcache_chunk_size": int,
                "lmcache_root": int, "chunks_indexed": bool}
        for key, kind in want.items():
            if not isinstance(d.get(key), kind):
                raise ValueError(f"stats hashing: {key} missing or not {kind.__name__} ({d.get(key)!r})")
        if d["lmcache_hash"] not in ("builtin", "sha256_cbor"):
            raise ValueError(f"stats hashing: unknown lmcache_hash {d['lmcache_hash']!r}")
        return cls(
            block_size=d["block_size"],
            fast_root=d["fast_root"],
            chunk_size=d["lmcache_chunk_size"],
            lmcache_algo=d["lmcache_hash"],
            lmcache_root=d["lmcache_root"],
            want_chunks=d["chunks_indexed"],
        )

    def differences(self, other: HashSettings) -> list[str]:
        """``field=mine->theirs`` for every field that differs."""
        return [
            f"{f}={getattr(self, f)!r}->{getattr(other, f)!r}"
            for f in self.__dataclass_fields__
            if getattr(self, f) != getattr(other, f)
        ]

    def chains(self, token_ids: TokenIds) -> list[HashChain]:
        """The prompt's chains as a ``route`` request carries them, each tagged with its root so
        the controller can refuse hashes made with other settings."""
        from smetric_lmc.wire import HashChain

        out = [HashChain("fast", self.block_size, fast_chain(token_ids, self.block_size, root=self.fast_root),
                         root=self.fast_root)]
        if self.want_chunks:
            chunks = lmcache_chunk_chain(token_ids, self.chunk_size, root=self.lmcache_root, algo=self.lmcache_algo)
            out.append(HashChain(self.lmcache_scheme, self.chunk_size, chunks, root=self.lmcache_root))
        return out
