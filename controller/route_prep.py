"""A route request's checked inputs, computed in the event loop or, for large frames, in a worker process.

Decoding, bounds-checking and hashing a route request costs time linear in its size, and a
controller answering a large one on its event loop freezes every other client and all event
ingest for that long (docs/measurements.md). These functions
are pure (no controller state), so :class:`FramePrep` can run them in a separate process for any
frame larger than ``offload_bytes``; the loop then only routes on the ready hash chains.

The worker returns one of:

- ``("error", code, message, request_id, is_route)``: the frame is refused (decoded once, in the
  worker);
- ``("route", slim_request, fast, chunks, n_tokens)``: ``slim_request`` is the request without its
  token ids and hash lists (they are not shipped back), ``fast``/``chunks`` its chains;
- ``("request", request)``: any other message, small once decoded, answered on the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from smetric_lmc.config import LimitsConfig
from smetric_lmc.controller.offload import OffloadWorker
from smetric_lmc.hashing import HashSettings, fast_chain, lmcache_chunk_chain
from smetric_lmc.wire import HashChain, RouteRequest, WireError, decode_request

#: Request ids longer than this are refused: each routed id is kept in memory until its done.
MAX_REQUEST_ID_CHARS = 512
#: Token ids are vocabulary indices; the index stores them as u32.
MAX_TOKEN_ID = (1 << 32) - 1
MAX_HASH = (1 << 64) - 1
MIN_SIGNED_HASH = -(1 << 63)
#: One chain per hash scheme ("fast", the LMCache schemes, vLLM's).
MAX_HASH_CHAINS = 4

RouteInputs = tuple[list[int], list[int] | None, int]


def decode_checked(payload: bytes, max_bytes: int) -> Any:
    """``decode_request`` (size cap ``max_bytes``: the configured ``limits.max_frame_bytes``) with
    nesting deeper than the interpreter allows reported as a WireError."""
    try:
        return decode_request(payload, max_bytes)
    except RecursionError:  # msgspec follows nesting with the interpreter's recursion limit
        raise WireError("bad_request", "nesting too deep") from None


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise WireError("bad_request", f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")


def request_id_of(req: Any) -> str | None:
    rid = getattr(req, "request_id", None)
    return rid[:MAX_REQUEST_ID_CHARS] if isinstance(rid, str) else None


def check_bounds(req: RouteRequest, lim: LimitsConfig) -> None:
    """Refuse out-of-range fields before any work proportional to them (C-speed scans only)."""
    cap = lim.max_prompt_tokens
    for name, value, top in (
        ("prompt_tokens", req.prompt_tokens, cap),
        ("est_hit_tokens", req.est_hit_tokens, cap),
        ("turn", req.turn, lim.max_turn),
    ):
        if value is not None and not 0 <= value <= top:
            raise WireError("bad_request", f"{name} must be within [0, {top}], got {value}")
    toks = req.token_ids
    if toks is not None and toks:
        if len(toks) > cap:
            raise WireError("too_large", f"{len(toks)} token_ids exceed limits.max_prompt_tokens={cap}")
        if min(toks) < 0 or max(toks) > MAX_TOKEN_ID:
            raise WireError("bad_request", f"token_ids must be within [0, {MAX_TOKEN_ID}]")
    if len(req.hashes) > MAX_HASH_CHAINS:
        raise WireError("bad_request", f"at most {MAX_HASH_CHAINS} hash chains")
    for hc in req.hashes:
        if not 0 < hc.block_size <= cap:
            raise WireError("bad_request", f"hash chain block_size must be within [1, {cap}]")
        if len(hc.hashes) > cap // hc.block_size + 1:
            raise WireError(
                "too_large", f"{len(hc.hashes)} hashes of {hc.block_size} tokens exceed "
                f"limits.max_prompt_tokens={cap}"
            )
        # LMCache's builtin chunk hashes are Python hash() values: signed 64-bit.
        low = MIN_SIGNED_HASH if hc.scheme == "lmcache_builtin" else 0
        if hc.hashes and (min(hc.hashes) < low or max(hc.hashes) > MAX_HASH):
            raise WireError("bad_request", f"{hc.scheme} hashes must be within [{'-2^63' if low else 0}, 2^64-1]")


def _check_root(hc: HashChain, root: int) -> None:
    if hc.root is not None and hc.root != root:
        # Hashes from another root match nothing here: routing on them would silently read every
        # hit as zero. Refuse loudly (the caller counts and logs the code).
        raise WireError("hash_mismatch", f"{hc.scheme} chain root {hc.root} differs from this index's {root}; "
                        "adopt the controller's stats()['hashing']")


def route_inputs(req: RouteRequest, hs: HashSettings, lim: LimitsConfig, fast_root: int) -> RouteInputs:
    """The request's fast block chain (rooted at ``fast_root``: the base or a LoRA adapter's root),
    its LMCache chunk chain, and its token count; WireError for anything out of bounds."""
    check_bounds(req, lim)
    fast: list[int] | None = None
    chunks: list[int] | None = None
    for hc in req.hashes:
        if hc.scheme == "fast":
            _check_root(hc, hs.fast_root)
            if hc.block_size != hs.block_size:
                raise WireError(
                    "bad_request", f"fast chain block_size {hc.block_size}; this index uses {hs.block_size}"
                )
            fast = hc.hashes
        elif hc.scheme == hs.lmcache_scheme:
            _check_root(hc, hs.lmcache_root)
            if hc.block_size != hs.chunk_size:
                raise WireError(
                    "bad_request", f"{hc.scheme} chunk size {hc.block_size}; this index uses {hs.chunk_size}"
                )
            chunks = hc.hashes
        else:
            raise WireError(
                "bad_request",
                f"hash scheme {hc.scheme!r} is not indexed here; send 'fast' at block size "
                f"{hs.block_size}, {hs.lmcache_scheme!r} at {hs.chunk_size}, or token_ids",
            )
    toks = req.token_ids
    if fast is None and chunks is None and toks is None:
        raise WireError("bad_request", "route needs token_ids or hashes")
    try:
        if fast is None and toks is not None:
            fast = fast_chain(toks, hs.block_size, root=fast_root)
        if chunks is None and toks is not None and hs.want_chunks:
            chunks = lmcache_chunk_chain(toks, hs.chunk_size, root=hs.lmcache_root, algo=hs.lmcache_algo)  # type: ignore[arg-type]
    except ValueError as exc:
        raise WireError("bad_request", str(exc)) from None
    fast = fast or []
    if toks is not None:
        n_tokens = len(toks)
    else:
        n_tokens = max(len(fast) * hs.block_size, len(chunks or ()) * hs.chunk_size)
    return fast, (chunks if hs.want_chunks else None), n_tokens


def prepare_frame(payload: bytes, hs: HashSettings, lim: LimitsConfig, fast_root: int) -> tuple[Any, ...]:
    """Decode, check and hash one frame (runs in the worker process; see the module docstring)."""
    try:
        req = decode_checked(payload, lim.max_frame_bytes)
    except WireError as exc:
        return ("error", exc.code, str(exc), None, False)
    if not isinstance(req, RouteRequest):
        return ("request", req)
    rid = request_id_of(req)
    try:
        check_request_id(req.request_id)
        fast, chunks, n = route_inputs(req, hs, lim, fast_root)
    except WireError as exc:
        return ("error", exc.code, str(exc), rid, True)
    slim = msgspec.structs.replace(req, token_ids=None if req.token_ids is None else [], hashes=[])
    return ("route", slim, fast, chunks, n)


class FramePrep(OffloadWorker):
    """The frame worker (:class:`OffloadWorker`) with the route service's settings: ``prepare``
    runs :func:`prepare_frame` there. The KV-event subscribers share the same process."""

    def __init__(self, hs: HashSettings, limits: LimitsConfig) -> None:
        super().__init__("frame worker")
        self.hs = hs
        self.limits = limits

    def prepare(self, payload: bytes, fast_root: int) -> asyncio.Future[tuple[Any, ...]]:
        return self.submit(prepare_frame, payload, self.hs, self.limits, fast_root)
