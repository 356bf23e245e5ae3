"""Kubernetes discovery of engine pods with the official ``kubernetes`` client (the ``k8s`` extra).

Like production-stack's ``--service-discovery k8s --k8s-service-discovery-type pod-ip``: the pods
of ``--k8s-namespace`` matching ``--k8s-label-selector`` are listed, then watched from the list's
resourceVersion. A pod is an engine at ``http://<podIP>:<k8s-port>``; it takes requests once every
container is ready and it is not terminating, and leaves routing when it is deleted, terminating
or not ready. The watch runs on a thread (the official client is synchronous) and hands each
change to the event loop; a watch that ends or fails is resumed from the last resourceVersion, or
re-listed (410 Gone, errors) with a bounded backoff.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodEngine:
    name: str
    ip: str | None
    ready: bool
    model: str | None  # the pod's ``model`` label (production-stack's chart sets it)
    created: float  # seconds since the epoch

    def url(self, port: int) -> str | None:
        return f"http://{self.ip}:{port}" if self.ip else None


def pod_engine(pod: Any) -> PodEngine:
    """What discovery needs of a ``V1Pod``."""
    meta, status = pod.metadata, pod.status
    statuses = (status.container_statuses if status is not None else None) or []
    ready = bool(statuses) and all(s.ready for s in statuses) and meta.deletion_timestamp is None
    created = meta.creation_timestamp.timestamp() if meta.creation_timestamp is not None else time.time()
    return PodEngine(name=meta.name, ip=status.pod_ip if status is not None else None, ready=ready,
                     model=(meta.labels or {}).get("model"), created=created)


OnPod = Callable[[PodEngine], None]
OnGone = Callable[[str], None]


class K8sDiscovery:
    """Lists and watches pods; calls ``on_pod`` for each pod seen or changed and ``on_gone`` for
    each pod deleted, both on the event loop given to :meth:`start`."""

    def __init__(self, namespace: str, label_selector: str, on_pod: OnPod, on_gone: OnGone, *,
                 api_client: Any = None, watch_timeout_s: int = 0, read_timeout_s: float = 60.0) -> None:
        self.namespace = namespace
        self.label_selector = label_selector
        self.on_pod, self.on_gone = on_pod, on_gone
        self._api_client = api_client
        self.watch_timeout_s = watch_timeout_s
        self.read_timeout_s = read_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.known: set[str] = set()
        self.healthy = False
        self.counters = {"lists": 0, "watches": 0, "events": 0, "errors": 0}

    def _api(self) -> Any:
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        return client.CoreV1Api(self._api_client)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _emit(self, fn: Callable[..., None], arg: Any) -> None:
        assert self._loop is not None
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, arg)

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        api = None
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if api is None:
                    api = self._api()
                if rv is None:
                    rv = self._list(api)
                self._watch = watch.Watch()
                self.counters["watches"] += 1
                kw: dict[str, Any] = {"label_selector": self.label_selector, "resource_version": rv,
                                      "_request_timeout": (10.0, self.read_timeout_s)}
                if self.watch_timeout_s > 0:
                    kw["timeout_seconds"] = self.watch_timeout_s
                for event in self._watch.stream(api.list_namespaced_pod, self.namespace, **kw):
                    if self._stop.is_set():
                        break
                    self.counters["events"] += 1
                    pod = event["object"]
                    rv = pod.metadata.resource_version or rv
                    self._apply(event["type"], pod)
                backoff = 0.5
            except ApiException as exc:
                self.counters["errors"] += 1
                if exc.status == 410:  # resourceVersion too old: list again
                    rv = None
                    continue
                self._failed(f"API {exc.status}: {exc.reason}", backoff)
                rv, backoff = None, min(backoff * 2, 10.0)
            except Exception as exc:  # connection reset, timeout, a malformed answer: re-list
                self.counters["errors"] += 1
                if self._stop.is_set():
                    break
                self._failed(repr(exc), backoff)
                rv, backoff = None, min(backoff * 2, 10.0)

    def _failed(self, why: str, backoff: float) -> None:
        self.healthy = False
        log.warning("k8s discovery: watch failed (%s); re-listing in %.1f s", why, backoff)
        self._stop.wait(backoff)

    def _list(self, api: Any) -> str:
        pods = api.list_namespaced_pod(self.namespace, label_selector=self.label_selector,
                                       _request_timeout=(10.0, self.read_timeout_s))
        self.counters["lists"] += 1
        names = set()
        for pod in pods.items:
            names.add(pod.metadata.name)
            self._apply("ADDED", pod)
        for gone in self.known - names:  # deleted while no watch was running
            self.known.discard(gone)
            self._emit(self.on_gone, gone)
        self.healthy = True
        log.info("k8s discovery: %d pods match %r in namespace %s", len(names), self.label_selector,
                 self.namespace)
        return pods.metadata.resource_version

    def _apply(self, kind: str, pod: Any) -> None:
        name = pod.metadata.name
        if kind == "DELETED":
            self.known.discard(name)
            self._emit(self.on_gone, name)
            return
        if kind not in ("ADDED", "MODIFIED"):
            return
        self.known.add(name)
        self._emit(self.on_pod, pod_engine(pod))
