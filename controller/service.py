"""The ``route`` service: a ZMQ ROUTER answering route / done / stats / health / instances.

Framing: a DEALER or REQ peer's message arrives as ``[identity, *envelope, b"", payload]`` and the
reply goes back as ``[identity, *envelope, b"", reply]``, so REQ sockets, DEALERs that tag requests
with a correlation frame, and ROUTER-DEALER proxies all work. ``[identity, payload]`` (a DEALER that
sends no delimiter) is answered as ``[identity, reply]``. Each payload is msgpack or JSON (see
``smetric_lmc.wire``) and is answered in the same encoding.

Routing is stateless: hashes come from the request, the decision from ``smetric_lmc.router``. A
controller whose index has not yet seen any local-tier data (just started) routes with the
load-balance policy, because every hit would read as zero and a cache-aware policy would only
mislabel sessions as evicted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from smetric_lmc.config import InstanceConfig, LimitsConfig, PolicyConfig
from smetric_lmc.controller.tasks import cancel_and_wait
from smetric_lmc.curve import ZapAllowList, check_keypair
from smetric_lmc.hashing import HashSettings, fast_chain, lmcache_chunk_chain
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.wire import (
    DoneAck,
    DoneReport,
    ErrorReply,
    HashChain,
    HealthReply,
    HealthRequest,
    InstanceInfo,
    InstancesReply,
    InstancesRequest,
    PrefilledAck,
    PrefilledReport,
    RouteDecision,
    RouteRequest,
    StatsReply,
    StatsRequest,
    WireError,
    decode_request,
    encode,
    is_json,
)

log = logging.getLogger(__name__)

#: Request ids longer than this are refused: each routed id is kept in memory until its done.
MAX_REQUEST_ID_CHARS = 512
#: Envelope frames a peer may put before the delimiter (proxies add one per hop).
MAX_ENVELOPE_FRAMES = 8
#: Frames up to this many times the limit get a "too_large" reply; larger ones are cut by ZMQ.
TRANSPORT_CAP_FACTOR = 4
#: Token ids are vocabulary indices; the index stores them as u32.
MAX_TOKEN_ID = (1 << 32) - 1
MAX_HASH = (1 << 64) - 1
#: One chain per hash scheme ("fast", the LMCache schemes, vLLM's).
MAX_HASH_CHAINS = 4


class RouteCore:
    """Answers decoded requests. Never raises: every failure becomes an ``ErrorReply``.

    The owner (the controller app) supplies the parts it alone knows through callables:
    ``stats_fn`` (extra stats), ``global_store_fn`` (global tier state for health), and tells it
    which instances are silent (``set_silent``): a routable instance is one registered in the
    index, not silent, and (in PD disaggregation) prefill-capable.
    """

    def __init__(
        self,
        index: TierIndex,
        load: LoadTracker,
        router: Router,
        instances: Sequence[InstanceConfig],
        hashing: HashSettings,
        *,
        disaggregated: bool = False,
        metrics: Any = None,
        stats_fn: Callable[[], dict[str, Any]] | None = None,
        global_store_fn: Callable[[], str] | None = None,
        limits: LimitsConfig | None = None,
        on_engine_error: Callable[[str, str], None] | None = None,
    ) -> None:
        self.limits = limits or LimitsConfig()
        self._on_engine_error = on_engine_error  # (instance_id, error kind) of a done that carries one
        self.index = index
        self.load = load
        self.router = router
        self.fallback = Router(index, load, PolicyConfig(name="load_balance"), disaggregated=disaggregated)
        self.hashing = hashing
        self.metrics = metrics
        self.disaggregated = disaggregated
        self._instances: dict[str, InstanceConfig] = {i.id: i for i in instances}
        # In PD disaggregation only prefill-capable instances take new requests.
        self._roles_ok: frozenset[str] | None = (
            frozenset(i.id for i in instances if i.role in ("prefill", "both")) if disaggregated else None
        )
        self._silent: frozenset[str] = frozenset()
        # None routes over every registered instance (the fast path); a list narrows it.
        self.candidates: list[str] | None = None
        self._update_candidates()
        self._stats_fn = stats_fn
        self._global_store_fn = global_store_fn
        self._ready = False
        self.catching_up = False
        self.counters: dict[str, int] = {
            "route": 0,
            "done": 0,
            "prefilled": 0,
            "stats": 0,
            "health": 0,
            "instances": 0,
            "degraded_routes": 0,
            "no_instance": 0,
            "errors": 0,
            "internal_errors": 0,
            "hash_mismatch": 0,
        }
        self.errors_by_code: dict[str, int] = {}

    # ---- state -------------------------------------------------------------------------------
    @property
    def index_ready(self) -> bool:
        """True once any local-tier data reached the index since start (latches); False while the
        owner says the index is catching up (a restored snapshot whose events are replaying)."""
        if self.catching_up:
            return False
        if not self._ready:
            s = self.index.stats
            if s["gpu_stored"] or s["lmcache_admitted"]:
                self._ready = True
                log.info("index ready: routing with policy=%s", self.router.policy_cfg.name)
        return self._ready

    def set_silent(self, silent: set[str] | frozenset[str]) -> None:
        """Instances that keep their index but take no new requests (silent past the timeout)."""
        self._silent = frozenset(silent)
        self._update_candidates()

    def _update_candidates(self) -> None:
        if self._roles_ok is None and not self._silent:
            self.candidates = None
            return
        ids = [i for i in self._instances if i not in self._silent]
        self.candidates = [i for i in ids if self._roles_ok is None or i in self._roles_ok]

    def endpoint_of(self, instance_id: str) -> str | None:
        inst = self._instances.get(instance_id)
        return inst.http if inst is not None else None

    # ---- entry point ---------------------------------------------------------------------------
    def handle(self, payload: bytes) -> bytes:
        """Decode, answer and encode one request payload.

        The payload is decoded once: a frame the schema rejects is answered without its
        request_id rather than decoded again schema-less (which would cost a hostile frame's
        worth of objects a second time).
        """
        t0 = time.perf_counter()
        as_json = is_json(payload)
        request_id: str | None = None
        try:
            try:
                req = decode_request(payload)
            except RecursionError:  # msgspec follows nesting with the interpreter's recursion limit
                raise WireError("bad_request", "nesting too deep") from None
            request_id = _request_id_of(req)
            reply, routed = self._dispatch(req)
        except WireError as exc:
            reply, routed = self._error(exc.code, str(exc), request_id), None
        except Exception as exc:  # a bug must cost one reply, not the controller
            log.exception("route service: internal error")
            self.counters["internal_errors"] += 1
            reply, routed = self._error("internal", f"{type(exc).__name__}: {exc}", request_id), None
        try:
            out = encode(reply, json=as_json)
        except Exception as exc:  # e.g. a stats value no encoder knows
            log.exception("route service: cannot encode reply")
            self.counters["internal_errors"] += 1
            out = encode(self._error("internal", f"cannot encode reply: {exc}", None), json=as_json)
        if routed is not None and self.metrics is not None:
            self.metrics.observe_route(routed, time.perf_counter() - t0, degraded=not self._ready)
        return out

    def error_frame(self, code: str, message: str, *, as_json: bool = False) -> bytes:
        """An encoded ErrorReply for problems found before decoding (framing, size)."""
        return encode(self._error(code, message, None), json=as_json)

    def _error(self, code: str, message: str, request_id: str | None) -> ErrorReply:
        self.counters["errors"] += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        if self.metrics is not None:
            self.metrics.observe_error(code)
        log.debug("route service: error code=%s request_id=%s message=%s", code, request_id, message)
        return ErrorReply(code=code, message=message[:1000], request_id=request_id)

    def _dispatch(self, req: Any) -> tuple[msgspec.Struct, RouteDecision | None]:
        if isinstance(req, RouteRequest):
            return self._route(req)
        if isinstance(req, DoneReport):
            return self._done(req), None
        if isinstance(req, PrefilledReport):
            self.counters["prefilled"] += 1
            _check_request_id(req.request_id)
            return PrefilledAck(request_id=req.request_id, applied=self.load.on_prefilled(req.request_id)), None
        if isinstance(req, StatsRequest):
            self.counters["stats"] += 1
            return StatsReply(stats=self.stats()), None
        if isinstance(req, HealthRequest):
            self.counters["health"] += 1
            return self.health(), None
        if isinstance(req, InstancesRequest):
            self.counters["instances"] += 1
            return InstancesReply(instances=self.instance_infos()), None
        raise WireError("bad_request", f"unsupported message {type(req).__name__}")

    # ---- route / done ---------------------------------------------------------------------------
    def _route(self, req: RouteRequest) -> tuple[msgspec.Struct, RouteDecision | None]:
        self.counters["route"] += 1
        _check_request_id(req.request_id)
        self._check_bounds(req)
        blocks, chunks, n_tokens = self._hashes(req)
        prompt = req.prompt_tokens if req.prompt_tokens is not None else n_tokens
        ready = self.index_ready
        router = self.router if ready else self.fallback
        if not ready:
            self.counters["degraded_routes"] += 1
        routed = router.route(
            req.request_id,
            blocks,
            chunks,
            prompt,
            turn=req.turn,
            est_hit=req.est_hit_tokens,
            candidates=self.candidates,
        )
        if routed.instance_id is None:
            self.counters["no_instance"] += 1
        else:
            routed.endpoint = self.endpoint_of(routed.instance_id)
        routed.index_ready = ready
        return routed, routed

    def _check_bounds(self, req: RouteRequest) -> None:
        """Refuse out-of-range fields before any work proportional to them (C-speed scans only)."""
        lim = self.limits
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
            if hc.hashes and (min(hc.hashes) < 0 or max(hc.hashes) > MAX_HASH):
                raise WireError("bad_request", "hashes must be within [0, 2^64-1]")

    def _hashes(self, req: RouteRequest) -> tuple[list[int], list[int] | None, int]:
        """The request's fast block chain and LMCache chunk chain, and its token count."""
        hs = self.hashing
        fast: list[int] | None = None
        chunks: list[int] | None = None
        for hc in req.hashes:
            if hc.scheme in ("fast", hs.lmcache_scheme):
                self._check_root(hc, hs.fast_root if hc.scheme == "fast" else hs.lmcache_root)
            if hc.scheme == "fast":
                if hc.block_size != hs.block_size:
                    raise WireError(
                        "bad_request", f"fast chain block_size {hc.block_size}; this index uses {hs.block_size}"
                    )
                fast = hc.hashes
            elif hc.scheme == hs.lmcache_scheme:
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
                # A route naming a LoRA adapter the engines reported hashes in that adapter's chain.
                fast = fast_chain(toks, hs.block_size, root=self.index.root_for(req.model, hs.fast_root))
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

    def _check_root(self, hc: HashChain, root: int) -> None:
        if hc.root is None or hc.root == root:
            return
        # Hashes from another root match nothing here: routing on them would silently read every
        # hit as zero. Refuse loudly (the error code is counted per code in the metrics).
        self.counters["hash_mismatch"] += 1
        log.warning("route refused: %s chain hashed from root %d; this index uses %d (the sender must adopt "
                    "stats()['hashing'])", hc.scheme, hc.root, root)
        raise WireError("hash_mismatch", f"{hc.scheme} chain root {hc.root} differs from this index's {root}; "
                        "adopt the controller's stats()['hashing']")

    def _done(self, req: DoneReport) -> DoneAck:
        self.counters["done"] += 1
        _check_request_id(req.request_id)
        released = self.load.on_done(req.request_id)
        if req.error is not None and req.instance_id is not None and self._on_engine_error is not None:
            self._on_engine_error(req.instance_id, req.error)
        if self.metrics is not None:
            self.metrics.observe_done(released, req.ok)
        return DoneAck(request_id=req.request_id, released=released)

    # ---- introspection ---------------------------------------------------------------------------
    def routable_ids(self) -> list[str]:
        ids = self.index.instances
        if self.candidates is not None:
            allowed = set(self.candidates)
            ids = [i for i in ids if i in allowed]
        return ids

    def health(self) -> HealthReply:
        n = len(self.routable_ids())
        store = self._global_store_fn() if self._global_store_fn is not None else "none"
        return HealthReply(ok=n > 0, routable_instances=n, index_ready=self.index_ready, global_store=store)

    def instance_infos(self) -> list[InstanceInfo]:
        registered = set(self.index.instances)
        counts = _gpu_block_counts(self.index, registered)
        return [
            InstanceInfo(
                id=inst.id,
                endpoint=inst.http,
                role=inst.role,
                routable=inst.id in registered and (self.candidates is None or inst.id in self.candidates),
                in_flight=self.load.in_flight(inst.id),
                unprefilled_tokens=self.load.unprefilled(inst.id),
                indexed_blocks=counts.get(inst.id, 0),
            )
            for inst in self._instances.values()
        ]

    def stats(self) -> dict[str, Any]:
        hs = self.hashing
        out: dict[str, Any] = {
            "policy": msgspec.structs.asdict(self.router.policy_cfg),
            "index_ready": self.index_ready,
            "degraded": not self.index_ready,
            "routable_instances": self.routable_ids(),
            "hashing": hs.as_stats(),
            "service": dict(self.counters),
            "errors_by_code": dict(self.errors_by_code),
            "index": {**self.index.stats, **self.index.sizes()},
            "load": dict(self.load.stats),
            "in_flight": len(self.load),
        }
        if self._stats_fn is not None:
            out.update(self._stats_fn())
        return out


def _check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise WireError("bad_request", f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")


def _request_id_of(req: Any) -> str | None:
    rid = getattr(req, "request_id", None)
    return rid[:MAX_REQUEST_ID_CHARS] if isinstance(rid, str) else None


def _gpu_block_counts(index: TierIndex, ids: set[str]) -> dict[str, int]:
    # Prefer a one-pass count if the index offers it; gpu_blocks_of scans the index per instance.
    counter = getattr(index, "gpu_block_counts", None)
    if callable(counter):
        return dict(counter())
    return {i: index.gpu_blocks_of(i) for i in ids}


def split_envelope(frames: Sequence[bytes]) -> tuple[list[bytes], bytes | None]:
    """``(reply prefix, payload)`` of a ROUTER message; payload None when the framing is wrong.

    The prefix is what the reply must start with to reach the peer: the identity, any envelope
    frames and the empty delimiter when the peer sent one.
    """
    n = len(frames)
    if n < 2:
        return [], None
    if n == 2:
        return [frames[0]], frames[1]
    for k in range(1, min(n, MAX_ENVELOPE_FRAMES + 2)):
        if not frames[k]:
            prefix = list(frames[: k + 1])
            return (prefix, frames[-1]) if k == n - 2 else (prefix, None)
    return [frames[0]], None


class RouteService:
    """Binds the route socket and answers requests one at a time on the event loop.

    Each request is answered synchronously (route decisions take tens of microseconds), so the
    loop needs no locking and replies keep request order per peer.
    """

    def __init__(
        self,
        core: RouteCore,
        url: str,
        *,
        curve_secret_key: str | None = None,
        curve_public_key: str | None = None,
        curve_client_keys: Sequence[str] | None = None,
        max_frame_bytes: int | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.core = core
        self.url = url
        self.max_frame_bytes = max_frame_bytes or core.limits.max_frame_bytes
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._curve = (curve_secret_key, curve_public_key)
        self._client_keys = list(curve_client_keys) if curve_client_keys is not None else None
        self._own_ctx: zmq.asyncio.Context | None = None
        self._zap: ZapAllowList | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.counters: dict[str, int] = {"frames": 0, "bad_frames": 0, "too_large": 0, "replies": 0, "send_errors": 0}

    def bind(self) -> str:
        """Bind the ROUTER (``tcp://127.0.0.1:*`` picks a free port); returns the bound endpoint.

        Raises ValueError for invalid CURVE keys (before anything is bound).
        """
        secret, public = self._curve
        if secret or public:
            check_keypair(secret, public)
            if self._client_keys is None:
                log.warning("route service: CURVE encrypts but accepts any client key (no allow-list given)")
            else:
                # ZAP is per context: a context of our own keeps every other socket out of it.
                self._own_ctx = zmq.asyncio.Context()
                self._ctx = self._own_ctx
                self._zap = ZapAllowList(zmq.Context.shadow(self._own_ctx.underlying), self._client_keys)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # The transport's hard cap, far above the checked limit: ZMQ cuts the connection on
        # anything larger without buffering it, while frames between the two get "too_large".
        sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_CAP_FACTOR * self.max_frame_bytes + 65536)
        if secret and public:
            sock.curve_server = True
            sock.curve_secretkey = secret.encode()
            sock.curve_publickey = public.encode()
        try:
            sock.bind(self.url)
        except zmq.ZMQError:
            sock.close(linger=0)
            self._stop_zap()
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("route service listening endpoint=%s curve=%s allow_list=%s", self.endpoint, bool(secret),
                 self._zap is not None)
        return self.endpoint

    @property
    def curve_counts(self) -> dict[str, int]:
        return self._zap.counts if self._zap is not None else {}

    def _stop_zap(self) -> None:
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._own_ctx is not None:
            self._own_ctx.destroy(linger=0)
            self._own_ctx = None

    async def run(self) -> None:
        """Serve until ``close()``."""
        if self._sock is None:
            self.bind()
        sock = self._sock
        assert sock is not None
        # A blocking-API view of the same socket: once the loop wakes us, every request already
        # queued is answered without a round trip through the event loop per message, and
        # ROUTER sends never block (a reply to a vanished peer is dropped by ZMQ).
        sync = zmq.Socket.shadow(sock.underlying)
        self._task = asyncio.current_task()
        while not self._closing:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                if self._closing:
                    return
                raise
            except zmq.ZMQError as exc:
                if self._closing or exc.errno == zmq.ENOTSOCK:
                    return
                log.warning("route service: receive failed error=%s", exc)
                continue
            answered = 0
            while True:
                self._reply(sync, frames)
                answered += 1
                if answered % self.DRAIN_MAX == 0:
                    await asyncio.sleep(0)  # a flood must not starve event ingest on the same loop
                    if self._closing:
                        return
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:  # zmq.Again: drained
                    break

    #: Requests answered per wake-up before yielding to the other tasks on the loop.
    DRAIN_MAX = 64

    def _reply(self, sync: zmq.Socket, frames: list[bytes]) -> None:
        reply = self._answer(frames)
        if reply is None:
            return
        # Counted before sending: a peer reading the counters after its reply sees it included.
        self.counters["replies"] += 1
        try:
            sync.send_multipart(reply, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's queue is full or it vanished: its problem
            self.counters["replies"] -= 1
            self.counters["send_errors"] += 1
            log.debug("route service: send failed error=%s", exc)

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        self.counters["frames"] += 1
        prefix, payload = split_envelope(frames)
        if not prefix:
            self.counters["bad_frames"] += 1
            return None
        if payload is None:
            self.counters["bad_frames"] += 1
            msg = "expected [identity, (envelope..., ''), payload]: one payload frame"
            return [*prefix, self.core.error_frame("bad_request", msg)]
        if len(payload) > self.max_frame_bytes:
            self.counters["too_large"] += 1
            msg = f"frame of {len(payload)} bytes exceeds {self.max_frame_bytes}"
            return [*prefix, self.core.error_frame("too_large", msg, as_json=is_json(payload))]
        return [*prefix, self.core.handle(payload)]

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._task)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._stop_zap()


__all__ = ["RouteCore", "RouteService", "split_envelope"]
