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
from smetric_lmc.controller.membership import Membership
from smetric_lmc.controller.offload import OFFLOAD_BYTES
from smetric_lmc.controller.route_prep import (
    FramePrep,
    RouteInputs,
    check_request_id,
    decode_checked,
    request_id_of,
    route_inputs,
)
from smetric_lmc.controller.tasks import LoopBudget, cancel_and_wait
from smetric_lmc.curve import ZapAllowList, check_keypair
from smetric_lmc.hashing import HashSettings
from smetric_lmc.index import TierIndex
from smetric_lmc.load import LoadTracker
from smetric_lmc.router import Router
from smetric_lmc.wire import (
    DoneAck,
    DoneReport,
    ErrorReply,
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
    encode,
    is_json,
)

log = logging.getLogger(__name__)

#: Envelope frames a peer may put before the delimiter (proxies add one per hop).
MAX_ENVELOPE_FRAMES = 8


def _import_multiprocessing() -> None:
    import concurrent.futures.process  # noqa: F401
    import multiprocessing  # noqa: F401


class Oversize(bytes):
    """Stands for a received frame over the size limit: its first byte (JSON or msgpack, for the
    reply's encoding) and its ``size``; the frame itself is released unread, never copied."""

    size: int

    @classmethod
    def of(cls, frame: zmq.Frame) -> Oversize:
        o = cls(frame.buffer[:1])
        o.size = len(frame)
        return o


def frames_within(raw: Sequence[zmq.Frame], limit: int) -> list[bytes]:
    """A message received with ``copy=False`` as bytes, frames over ``limit`` as ``Oversize``."""
    return [f.bytes if len(f) <= limit else Oversize.of(f) for f in raw]


class RouteCore:
    """Answers decoded requests. Never raises: every failure becomes an ``ErrorReply``.

    The owner (the controller app) supplies the parts it alone knows through callables:
    ``stats_fn`` (extra stats), ``global_store_fn`` (global tier state for health), and the
    ``membership`` that says who may be routed to (registered in the index, alive, breaker
    closed, and in PD disaggregation prefill-capable). Without one, every registered instance is.
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
        membership: Membership | None = None,
    ) -> None:
        self.limits = limits or LimitsConfig()
        self._on_engine_error = on_engine_error  # (instance_id, error kind) of a done that carries one
        self.index = index
        self.load = load
        self.router = router
        self.fallback = Router(index, load, PolicyConfig(name="load_balance"), disaggregated=disaggregated,
                               rotation=router.rotation)
        self.fallback.prices = router.prices  # its routes' done reports teach the same estimator
        self.hashing = hashing
        self.metrics = metrics
        self.disaggregated = disaggregated
        self.membership = membership or Membership(instances, index, load, disaggregated=disaggregated)
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
        # Hooks for replicas sharing load (controller.replicas): called after a route assigned an
        # instance, and for every done and prefilled report (known here or not).
        self.on_routed: Callable[[str, str, int, RouteDecision], None] | None = None
        self.on_done_report: Callable[[str], None] | None = None
        self.on_prefilled_report: Callable[[str], None] | None = None

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

    @property
    def candidates(self) -> list[str] | None:
        """What the router may pick from (None: every registered instance), as membership says."""
        return self.membership.candidates

    def endpoint_of(self, instance_id: str) -> str | None:
        inst = self.membership.instances.get(instance_id)
        return inst.http if inst is not None else None

    # ---- entry point ---------------------------------------------------------------------------
    def handle(self, payload: bytes) -> bytes:
        """Decode, answer and encode one request payload.

        The payload is decoded once: a frame the schema rejects is answered without its
        request_id rather than decoded again schema-less (which would cost a hostile frame's
        worth of objects a second time).
        """
        t0 = time.perf_counter()
        try:
            req = decode_checked(payload, self.limits.max_frame_bytes)
        except WireError as exc:
            return self._finish(self._error(exc.code, str(exc), None), None, is_json(payload), t0)
        return self.answer(req, is_json(payload), t0=t0)

    def answer(self, req: Any, as_json: bool, *, prepared: RouteInputs | None = None,
               t0: float | None = None) -> bytes:
        """Answer a decoded request; ``prepared`` carries a route's inputs computed off the loop."""
        t0 = time.perf_counter() if t0 is None else t0
        request_id = request_id_of(req)
        try:
            reply, routed = self._dispatch(req, prepared)
        except WireError as exc:
            reply, routed = self._error(exc.code, str(exc), request_id), None
        except Exception as exc:  # a bug must cost one reply, not the controller
            log.exception("route service: internal error")
            self.counters["internal_errors"] += 1
            reply, routed = self._error("internal", f"{type(exc).__name__}: {exc}", request_id), None
        return self._finish(reply, routed, as_json, t0)

    def refuse(self, code: str, message: str, request_id: str | None, as_json: bool, *, route: bool) -> bytes:
        """The encoded refusal of a frame checked off the loop (counted as the loop counts it)."""
        if route:
            self.counters["route"] += 1
        if code == "hash_mismatch":
            self._count_mismatch(message)
        return encode(self._error(code, message, request_id), json=as_json)

    def _finish(self, reply: msgspec.Struct, routed: RouteDecision | None, as_json: bool, t0: float) -> bytes:
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

    def _dispatch(self, req: Any, prepared: RouteInputs | None = None) -> tuple[msgspec.Struct, RouteDecision | None]:
        if isinstance(req, RouteRequest):
            return self._route(req, prepared)
        if isinstance(req, DoneReport):
            return self._done(req), None
        if isinstance(req, PrefilledReport):
            self.counters["prefilled"] += 1
            check_request_id(req.request_id)
            applied = self.load.on_prefilled(req.request_id)
            if self.on_prefilled_report is not None:
                self.on_prefilled_report(req.request_id)
            return PrefilledAck(request_id=req.request_id, applied=applied), None
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
    def _route(self, req: RouteRequest, prepared: RouteInputs | None = None) -> tuple[msgspec.Struct, RouteDecision | None]:
        self.counters["route"] += 1
        check_request_id(req.request_id)
        if prepared is None:
            prepared = self.route_inputs(req)
        blocks, chunks, n_tokens = prepared
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
            candidates=self.membership.candidates,
        )
        if routed.instance_id is None:
            self.counters["no_instance"] += 1
        else:
            routed.endpoint = self.endpoint_of(routed.instance_id)
            if self.on_routed is not None:
                self.on_routed(req.request_id, routed.instance_id, prompt, routed)
        routed.index_ready = ready
        return routed, routed

    def fast_root_for(self, model: str) -> int:
        """The chain root a route for ``model`` hashes token ids under (a LoRA adapter's or the base)."""
        return self.index.root_for(model, self.hashing.fast_root)

    def route_inputs(self, req: RouteRequest) -> RouteInputs:
        try:
            return route_inputs(req, self.hashing, self.limits, self.fast_root_for(req.model))
        except WireError as exc:
            if exc.code == "hash_mismatch":
                self._count_mismatch(str(exc))
            raise

    def _count_mismatch(self, message: str) -> None:
        self.counters["hash_mismatch"] += 1
        log.warning("route refused: %s (the sender must adopt stats()['hashing'])", message)

    def _done(self, req: DoneReport) -> DoneAck:
        self.counters["done"] += 1
        check_request_id(req.request_id)
        released = self.load.on_done(req.request_id)
        feed = self.router.prices
        if feed is not None:  # what the request cost teaches the price estimator (smetric_lmc.prices)
            feed.on_done(req.request_id, ok=req.ok, ttft_s=req.ttft_s, e2e_s=req.e2e_s,
                         output_tokens=req.output_tokens, cached_tokens=req.cached_tokens,
                         prompt_tokens=req.prompt_tokens)
        if self.on_done_report is not None:
            self.on_done_report(req.request_id)
        if req.error is not None and req.instance_id is not None and self._on_engine_error is not None:
            self._on_engine_error(req.instance_id, req.error)
        if self.metrics is not None:
            self.metrics.observe_done(released, req.ok)
        return DoneAck(request_id=req.request_id, released=released)

    # ---- introspection ---------------------------------------------------------------------------
    def routable_ids(self) -> list[str]:
        return self.membership.routable_ids()

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
            for inst in self.membership.instances.values()
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
        if self.router.prices is not None:
            out["prices"] = self.router.prices.snapshot()
        if self._stats_fn is not None:
            out.update(self._stats_fn())
        return out


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
        self._prep_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.counters: dict[str, int] = {"frames": 0, "bad_frames": 0, "too_large": 0, "replies": 0, "send_errors": 0,
                                         "offloaded": 0, "large_on_loop": 0}
        self._prep = FramePrep(core.hashing, core.limits)
        self._offloaded: set[asyncio.Future[None]] = set()

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
        # Every frame over max_frame_bytes, up to the transport cap, is received uncopied, answered
        # "too_large" and counted. The cap bounds what ZMQ holds while a frame arrives: beyond it ZMQ
        # drops the sender's connection mid-frame, the only way to refuse a frame without reading it.
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.core.limits.max_transport_bytes, self.max_frame_bytes))
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
    def worker(self) -> FramePrep:
        """The frame worker process, shared with the KV-event subscribers."""
        return self._prep

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

    #: Requests answered per wake-up before yielding to the other tasks on the loop.
    DRAIN_BUDGET = LoopBudget()
    #: Frames larger than this are decoded, checked and hashed in the worker process (FramePrep).
    OFFLOAD_BYTES = OFFLOAD_BYTES
    #: Large frames in the worker at once; the service stops reading while this many are pending.
    MAX_OFFLOADED = 4

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
        self._prep_task = asyncio.create_task(self._start_prep_later(), name="frame-worker-start")
        meter = self.DRAIN_BUDGET.meter()
        while not self._closing:
            try:
                frames = frames_within(await sock.recv_multipart(copy=False), self.max_frame_bytes)
            except asyncio.CancelledError:
                if self._closing:
                    return
                raise
            except zmq.ZMQError as exc:
                if self._closing or exc.errno == zmq.ENOTSOCK:
                    return
                log.warning("route service: receive failed error=%s", exc)
                continue
            meter.reset()
            while True:
                if meter.spend(self._serve(sync, frames)):
                    await asyncio.sleep(0)  # a flood must not starve event ingest on the same loop
                    if self._closing:
                        return
                    meter.reset()
                while len(self._offloaded) >= self.MAX_OFFLOADED:
                    await asyncio.wait(self._offloaded, return_when=asyncio.FIRST_COMPLETED)
                try:
                    frames = frames_within(sync.recv_multipart(zmq.NOBLOCK, copy=False), self.max_frame_bytes)
                except zmq.ZMQError:  # zmq.Again: drained
                    break

    #: The frame worker starts this long after the service (a large frame before then starts it):
    #: its process and multiprocessing's imports must not compete with a restart's first routes.
    PREP_START_S = 1.0

    async def _start_prep_later(self) -> None:
        await asyncio.sleep(self.PREP_START_S)
        await asyncio.to_thread(_import_multiprocessing)  # the worker's imports run off the loop
        if not self._closing:
            self._prep.start()

    def _serve(self, sync: zmq.Socket, frames: list[bytes]) -> int:
        """Answer one message (or hand it to the worker); returns the bytes handled here."""
        self.counters["frames"] += 1
        prefix, payload, reply = self._check_framing(frames)
        if reply is None and payload is not None:
            if len(payload) > self.OFFLOAD_BYTES:
                if self._prep.start():  # started already, or now (a large frame in the first second)
                    self.counters["offloaded"] += 1
                    task = asyncio.ensure_future(self._answer_offloaded(prefix, payload))
                    self._offloaded.add(task)
                    task.add_done_callback(self._offloaded.discard)
                    return 0
                self.counters["large_on_loop"] += 1  # no worker here (logged once by FramePrep)
            reply = [*prefix, self.core.handle(payload)]
        if reply is not None:
            self._send(sync, reply)
        return len(frames[-1])

    async def _answer_offloaded(self, prefix: list[bytes], payload: bytes) -> None:
        as_json = is_json(payload)
        core = self.core
        t0 = time.perf_counter()
        try:
            out = await self._prep.prepare(payload, core.hashing.fast_root)
            if out[0] == "route" and out[1].token_ids is not None:
                root = core.fast_root_for(out[1].model)
                if root != core.hashing.fast_root:  # a LoRA adapter's chain: hash again under its root
                    out = await self._prep.prepare(payload, root)
        except Exception as exc:  # the worker died (BrokenProcessPool) or could not take the frame
            log.error("route service: frame worker failed error=%s", exc)
            core.counters["internal_errors"] += 1
            reply = core.error_frame("internal", f"frame worker failed: {type(exc).__name__}", as_json=as_json)
        else:
            if out[0] == "error":
                reply = core.refuse(out[1], out[2], out[3], as_json, route=out[4])
            elif out[0] == "route":
                reply = core.answer(out[1], as_json, prepared=(out[2], out[3], out[4]), t0=t0)
            else:
                reply = core.answer(out[1], as_json, t0=t0)
        if not self._closing:
            self._send_waking([*prefix, reply])

    def _send_waking(self, reply: list[bytes]) -> None:
        """``_send`` from a task of its own, while ``run`` may wait for the socket's descriptor.

        ZMQ signals that descriptor once per batch of arrivals, and a send that takes in a new
        request clears the signal: ``run`` then waited for good while requests queued up (the
        route service hung under bench/soak.py's storm of large frames). A send through the asyncio
        socket makes pyzmq look for such requests afterwards and hand them to the waiting receive.
        """
        if self._sock is None:
            return
        self.counters["replies"] += 1
        try:
            sent = self._sock.send_multipart(reply, zmq.NOBLOCK)  # done at once: no send here waits
        except zmq.ZMQError as exc:  # the socket closed under us
            self._send_failed(exc)
            return
        sent.add_done_callback(self._count_failed_send)

    def _count_failed_send(self, sent: asyncio.Future[Any]) -> None:
        if sent.cancelled() or sent.exception() is not None:
            self._send_failed(None if sent.cancelled() else sent.exception())

    def _send(self, sync: zmq.Socket, reply: list[bytes]) -> None:
        # Counted before sending: a peer reading the counters after its reply sees it included.
        self.counters["replies"] += 1
        try:
            sync.send_multipart(reply, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's queue is full or it vanished: its problem
            self._send_failed(exc)

    def _send_failed(self, exc: BaseException | None) -> None:
        self.counters["replies"] -= 1
        self.counters["send_errors"] += 1
        log.debug("route service: send failed error=%s", exc)

    def _check_framing(self, frames: list[bytes]) -> tuple[list[bytes], bytes | None, list[bytes] | None]:
        """``(prefix, payload, reply)``: a reply when framing or size refuse the message outright."""
        prefix, payload = split_envelope(frames)
        if not prefix:
            self.counters["bad_frames"] += 1
            return prefix, None, None
        if payload is None:
            self.counters["bad_frames"] += 1
            msg = "expected [identity, (envelope..., ''), payload]: one payload frame"
            return prefix, None, [*prefix, self.core.error_frame("bad_request", msg)]
        if isinstance(payload, Oversize) or len(payload) > self.max_frame_bytes:
            self.counters["too_large"] += 1
            size = payload.size if isinstance(payload, Oversize) else len(payload)
            msg = f"frame of {size} bytes exceeds {self.max_frame_bytes}"
            return prefix, None, [*prefix, self.core.error_frame("too_large", msg, as_json=is_json(payload))]
        return prefix, payload, None

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._prep_task)
        await cancel_and_wait(self._task)
        for task in list(self._offloaded):
            task.cancel()
        await asyncio.gather(*self._offloaded, return_exceptions=True)
        self._prep.close()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._stop_zap()


__all__ = ["RouteCore", "RouteService", "split_envelope"]
