"""``hetserve route``'s HTTP app: the OpenAI API in front of OpenAI-compatible backends.

A request is validated with ``hetserve serve``'s own request models (``serve.protocol``) and its
errors come back in the same JSON shape (``serve.errors``); the body the client sent is then
forwarded as it is. One backend takes it (``BackendPool.pick_entry``). Under P/D the vLLM
disaggregated-proxy protocol applies (as vLLM's ``toy_proxy_server.py``): the prefill backend
gets the body with ``max_tokens`` 1, ``stream`` false, no ``stream_options`` / ``min_tokens`` and
``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``;
the ``kv_transfer_params`` of its answer go, with the client's body, to the decode backend the
plan's KV routes pick, whose answer (streamed or not) is the client's.

Retry rule: until the first byte of the answer has gone to the client, a failure (connection
refused or reset, a 5xx, a stream that breaks) marks that backend down and the request is tried on
another live one; after that (its status line has left), a stream that breaks ends as ``serve``
ends one that fails: an error event, then ``data: [DONE]``. Streams are relayed one whole event at
a time (``route.sse``): the event a backend was cut off inside never reaches the client. An SSE
comment (serve's keep-alive on a quiet stream) is relayed as any event, and commits the request as
a first byte does; a frozen backend sends none, so the stall timeout below still ends its stream.
A backend's 4xx is the client's answer, not a failure, except 401 and 403: those refuse route's own credentials (no
``--backend-api-key-file``, or a key the backend does not take), which is route's misconfiguration,
not the client's, so the client gets a 502 saying so (never the backend's words about "your key")
and the log names the backend and the option, once per backend. Health checks (``GET /health``
every ``health_interval_s``) mark backends up again, and down: at once when the connection is
refused (nothing listens), after ``health_failures`` checks in a row when the answer is slow or not
200 (one slow answer from a busy backend is not an outage). A request waiting on a backend that is
down and whose health check got no answer at all (a 503 says it lives: draining, or holding requests
for a re-plan), for ``stall_s`` or more, fails as a broken connection would (``route.waits``): one not
answered yet moves to another backend, a stream ends with an error event. Each change of a backend's state is logged with why (the status
or error of the check or request that decided it).

Shutdown is ``hetserve serve``'s (``serve.server``, ``serve.shutdown``): ``drain`` refuses new requests
(``ShuttingDown``, 503) while those in flight (``in_flight``, counted by ``route.server``) finish;
``end_now`` answers the rest at once, a stream with an error event and ``[DONE]``, a request not
answered yet with the 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import AsyncIterator

import httpx

from hetserve.serve.bodies import ClientGone
from hetserve.serve.errors import STREAM_END, APIError, ServerError, ShuttingDown, Unavailable, error_event
from hetserve.serve.request_ids import HEADER as REQUEST_ID_HEADER, current_request_id
from hetserve.serve.route.backends import Backend, BackendPool
from hetserve.serve.route.relay import Relay
from hetserve.serve.route.waits import Stalled, Waits, Woken
from hetserve.serve.shutdown import drain, wait_answered

log = logging.getLogger(__name__)

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


class BackendFailed(Exception):
    """A backend failed before anything reached the client: try another."""


CLIENT_POLL_S = 0.25  # how often a client waiting for its answer's first byte is checked for, as serve's
CREDENTIALS_REFUSED = (401, 403)  # a backend's answer to the key route sends (or does not send)
_ERROR_EVENT = re.compile(rb'(?:^|[\r\n])data: ?\{\s*"error"')  # an SSE error event, as serve and vLLM send one


class BackendRefusedCredentials(APIError):
    """What the client hears when a backend refuses route's credentials: a gateway problem, not its key's."""
    status, type, code = 502, "server_error", "backend_refused_credentials"

    def __init__(self, backend: str, status: int):
        super().__init__(f"backend {backend} refused this router's credentials (HTTP {status}); the router's "
                         "operator must give it the backends' key (--backend-api-key-file)")


class Metrics:
    """Per-backend Prometheus metrics in a registry of this app's own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("hetserve_route_requests", "requests answered, per backend and outcome",
                                ["backend", "outcome"], registry=self.registry)
        self.retries = Counter("hetserve_route_retries", "requests moved off a failed backend", ["backend"],
                               registry=self.registry)
        self.up = Gauge("hetserve_route_backend_up", "1 when the backend is in service", ["backend"],
                        registry=self.registry)
        self.in_flight = Gauge("hetserve_route_in_flight", "requests in flight per backend", ["backend"],
                               registry=self.registry)
        self.ttfb = Histogram("hetserve_route_first_byte_seconds", "time to the backend's first byte",
                              ["backend"], registry=self.registry,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self._children: dict[str, tuple] = {}

    def of(self, backend: str):
        """(in_flight gauge, first-byte histogram) of one backend, looked up once."""
        hit = self._children.get(backend)
        if hit is None:
            hit = self._children[backend] = (self.in_flight.labels(backend), self.ttfb.labels(backend))
        return hit

    def render(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


class Router:
    """Sends one request to backends by the module docstring's rules."""

    def __init__(self, pool: BackendPool, timeout_s: float = 600.0, health_interval_s: float = 1.0,
                 api_key: str | None = None, health_failures: int = 3, stall_s: float = 10.0):
        if health_failures < 1:
            raise ValueError(f"health_failures must be at least 1, got {health_failures}")
        self.pool = pool
        self.metrics = Metrics()
        self.health_interval_s = health_interval_s
        self.health_failures = health_failures
        self._failed_checks: dict[str, int] = {}  # consecutive failed health checks per backend
        self._refused_told: set[str] = set()  # backends whose credentials refusal is logged already
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        for b in pool.config.backends:
            self.metrics.up.labels(b.id).set(1 if b.alive else 0)
        self._health_task: asyncio.Task | None = None
        self.in_flight = 0  # API requests being answered (route.server counts them)
        self.draining = False  # a graceful shutdown began: new requests are refused
        self._ended: asyncio.Future | None = None  # its result: why end_now ended the requests in flight
        self.waits = Waits(stall_s)  # the requests' waits on backends (route.waits)

    # ------------------------------------------------------------------ health
    def start(self) -> None:
        if self.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(b) for b in self.pool.config.backends))
            await asyncio.sleep(self.health_interval_s)

    async def check(self, b: Backend) -> None:
        """One health check of ``b``, by the module docstring's rule."""
        refused, answered = False, False
        try:
            # with the backends' key: a backend that guards its probes (--protect-probes) answers 401 without it
            r = await self.client.get(f"{b.url}/health", headers=self.headers, timeout=2.0)
            answered = True
            ok = r.status_code == 200
            why = f"GET /health answered HTTP {r.status_code}"
            if r.status_code in CREDENTIALS_REFUSED:
                why += " (" + self.credentials_refused(b, r.status_code) + ")"
        except httpx.ConnectError as exc:  # nothing listens: down now
            ok, refused, why = False, True, f"GET /health: connection failed ({str(exc) or type(exc).__name__})"
        except httpx.HTTPError as exc:
            ok, why = False, f"GET /health: {type(exc).__name__} {exc}".rstrip()
        failed = 0 if ok else self.health_failures if refused else self._failed_checks.get(b.id, 0) + 1
        self._failed_checks[b.id] = failed
        if ok or failed >= self.health_failures:
            self._set_alive(b, ok, why if not ok else "GET /health answered 200")
        # a backend that answers, even 503 (a server draining, or holding requests for a re-plan), is
        # alive and its requests may yet be answered; one down that answers nothing has gone quiet
        if not b.alive and not answered:
            ended = self.waits.end_stalled(b)
            if ended:
                log.warning("backend %s (%s) is down and answers nothing: %d request(s) waiting on it for %g s or "
                            "more moved or ended", b.id, b.url, ended, self.waits.stall_s)

    def _set_alive(self, b: Backend, ok: bool, why: str) -> None:
        if ok != b.alive:  # the operator hears of each change and why, not only /health and /metrics
            log.warning("backend %s (%s) is %s: %s", b.id, b.url, "up again" if ok else "down", why)
        b.alive = ok
        self.metrics.up.labels(b.id).set(1 if ok else 0)

    def credentials_refused(self, b: Backend, status: int) -> str:
        """Why ``b`` answered ``status`` (401/403) to route, logged the first time for ``b``."""
        fix = ("the key in --backend-api-key-file is not one it takes" if self.headers
               else "give route the backends' key with --backend-api-key-file")
        why = f"it refuses route's credentials: {fix}"
        if b.id not in self._refused_told:
            self._refused_told.add(b.id)
            log.error("backend %s (%s) answered HTTP %d: %s", b.id, b.url, status, why)
        return why

    # ------------------------------------------------------------------ shutdown
    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """As ``Coordinator.drain``: admit nothing new, wait up to ``timeout_s``, end those left."""
        return await drain(self, timeout_s, poll_s=poll_s)

    async def end_now(self, reason: str, grace_s: float = 5.0, poll_s: float = 0.05) -> None:
        """End every request in flight with ``reason`` (module docstring), then wait up to ``grace_s``
        for them to be answered."""
        self.draining = True
        ended = self._end_signal()
        if not ended.done():
            ended.set_result(reason)
        self.waits.wake_reads()  # streams awaiting a backend: woken to end (``_read``)
        await wait_answered(self, grace_s, poll_s=poll_s)

    async def _read(self, b: Backend, chunks) -> bytes:
        """A stream's next bytes from ``b``, or ``ShuttingDown`` once ``end_now`` ended it. Only a read
        is woken by ``end_now`` (a stream writing to its client is not: its write would break)."""
        if self._ended is not None and self._ended.done():
            raise ShuttingDown(self._ended.result())
        try:
            return await self.waits.on(b, chunks.__anext__(), read=True)
        except Woken:
            raise ShuttingDown(self._end_signal().result()) from None

    def _end_signal(self) -> asyncio.Future:
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    async def until_ended(self, aw, client_gone=None):
        """``aw``'s result; ``ShuttingDown`` if ``end_now`` comes first, ``ClientGone`` if ``client_gone()``
        (polled) does. ``aw`` is then cancelled, closing its request to the backend: a backend that aborts
        on a disconnect (``hetserve serve``) stops generating for nobody."""
        ended = self._end_signal()
        if ended.done():
            aw.close()
            raise ShuttingDown(ended.result())
        task = asyncio.ensure_future(aw)
        try:
            while True:
                await asyncio.wait((task, ended), timeout=CLIENT_POLL_S if client_gone else None,
                                   return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                if ended.done() or await client_gone():
                    break
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        if task.cancelled():
            raise ShuttingDown(ended.result()) if ended.done() else ClientGone()
        return task.result()  # it finished before the cancel landed: its answer stands

    # ------------------------------------------------------------------ requests
    async def answer(self, path: str, body: dict, raw: bytes | None = None
                     ) -> tuple[int, dict | None, AsyncIterator[bytes] | None]:
        """(status, JSON body, None) or (status, None, byte stream) for the client; ``raw``: the
        body's bytes as received (forwarded as they are where the body goes on unchanged)."""
        tried: set[str] = set()
        while True:
            entry = self.pool.pick_entry(tried)
            if entry is None:
                raise Unavailable("no backend can serve: every one is down", param=None)
            tried.add(entry.id)
            try:
                if entry.role == "prefill":
                    return await self._disaggregated(entry, path, body)
                return await self._send(entry, path, body, raw=raw)
            except BackendFailed:
                self.metrics.retries.labels(entry.id).inc()
                continue

    async def _disaggregated(self, prefill: Backend, path: str, body: dict):
        req = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        req.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
        if "max_completion_tokens" in body:
            req["max_completion_tokens"] = 1
        status, data, _ = await self._send(prefill, path, req, stream=False)
        if status != 200:
            return status, data, None
        decode_body = dict(body)
        if isinstance(data, dict) and data.get("kv_transfer_params"):
            decode_body["kv_transfer_params"] = data["kv_transfer_params"]
        tried: set[str] = set()
        while True:
            d = self.pool.pick_decode(prefill.id, tried)
            if d is None:
                raise BackendFailed(f"no decode backend for {prefill.id}")
            tried.add(d.id)
            try:
                return await self._send(d, path, decode_body)
            except BackendFailed:
                self.metrics.retries.labels(d.id).inc()

    async def _send(self, b: Backend, path: str, body: dict, stream: bool | None = None, raw: bytes | None = None):
        """``body`` to ``b`` (``raw``: its bytes as the client sent them, forwarded unchanged)."""
        stream = bool(body.get("stream")) if stream is None else stream
        in_flight, ttfb = self.metrics.of(b.id)
        b.in_flight += 1
        in_flight.set(b.in_flight)
        t0 = time.perf_counter()
        done = True
        try:
            if raw is None:
                raw = json.dumps(body).encode()
            # the client's request id goes along, so the backend's log names the request as the route's does
            rid = current_request_id()
            req = self.client.build_request("POST", f"{b.url}{path}", content=raw,
                                            headers={**self.headers, "content-type": "application/json",
                                                     **({REQUEST_ID_HEADER: rid} if rid else {})})
            try:
                resp = await self.waits.on(b, self.client.send(req, stream=True))
            except httpx.HTTPError as exc:
                self._failed(b, f"POST {path}: {type(exc).__name__} {exc}".rstrip())
                raise BackendFailed(f"{b.id}: {exc}") from exc
            if resp.status_code >= 500:
                await resp.aclose()
                self._failed(b, f"POST {path} answered HTTP {resp.status_code}")
                raise BackendFailed(f"{b.id}: HTTP {resp.status_code}")
            if resp.status_code in CREDENTIALS_REFUSED:  # route's key, not the client's (module docstring)
                await resp.aclose()
                self.credentials_refused(b, resp.status_code)
                self.metrics.requests.labels(b.id, str(resp.status_code)).inc()
                raise BackendRefusedCredentials(b.id, resp.status_code)
            if not stream or resp.status_code != 200:
                try:
                    raw = await self.waits.on(b, resp.aread())
                except httpx.HTTPError as exc:
                    self._failed(b, f"POST {path}: reading the answer: {type(exc).__name__} {exc}".rstrip())
                    raise BackendFailed(f"{b.id}: {exc}") from exc
                finally:
                    await resp.aclose()
                ttfb.observe(time.perf_counter() - t0)
                self.metrics.requests.labels(b.id, str(resp.status_code)).inc()
                try:
                    return resp.status_code, json.loads(raw), None
                except json.JSONDecodeError as exc:
                    self._failed(b, f"POST {path}: HTTP {resp.status_code} answer is not JSON")
                    raise BackendFailed(f"{b.id}: answer is not JSON") from exc
            chunks = resp.aiter_raw()
            try:  # the first bytes decide: a stream that breaks before them is retried elsewhere
                first = await self.waits.on(b, chunks.__anext__())
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                await resp.aclose()
                self._failed(b, f"POST {path}: stream ended before its first byte ({type(exc).__name__})")
                raise BackendFailed(f"{b.id}: stream ended before its first byte") from exc
            ttfb.observe(time.perf_counter() - t0)
            done = False
            return 200, None, Relay(self._relay(b, resp, first, chunks), lambda: self._release(b, resp, "200"))
        finally:
            if done:
                b.in_flight -= 1
                in_flight.set(b.in_flight)

    async def _relay(self, b: Backend, resp, first: bytes, chunks) -> AsyncIterator[bytes]:
        from hetserve.serve.line_ends import escape_line_ends
        from hetserve.serve.route.sse import EventCutter

        outcome = "200"
        cutter = EventCutter()  # whole events only reach the client (route.sse says why)
        reason = None  # why the stream broke, if it did
        error = None  # what ended the stream early: a broken backend's, or the shutdown's
        try:
            c = first
            while True:
                whole = cutter.feed(c)
                if whole:
                    if outcome == "200" and _ERROR_EVENT.search(whole):
                        outcome = "error"  # the backend ended it with an error event (relayed as it is)
                    yield escape_line_ends(whole)  # as serve sends its own (line_ends says why)
                if cutter.too_long:
                    reason = f"backend {b.id} sent an event over {cutter.max_event_bytes} bytes"
                    break
                try:
                    c = await self._read(b, chunks)
                except ShuttingDown as exc:  # the shutdown ended it: as serve ends its streams
                    error = exc
                    break
                except StopAsyncIteration:
                    rest = cutter.rest()
                    if rest:
                        yield escape_line_ends(rest)
                    break
                except httpx.HTTPError as exc:
                    self._set_alive(b, False, f"stream broke midway ({type(exc).__name__} {exc})".rstrip())
                    reason = f"backend {b.id} failed mid-stream" + (f": {exc}" if isinstance(exc, Stalled) else "")
                    break
            if reason is not None:
                outcome = "broken"  # counted once, as broken: not as a failed attempt too
                error = ServerError(reason)
            elif error is not None:
                outcome = "ended"
            if error is not None:
                # as serve ends a stream that fails after its headers: one error event, then [DONE]
                # (a client reads to [DONE]); the event the backend was cut off inside is dropped,
                # never sent in part (a client would fail decoding it and never read the error)
                yield error_event(error).encode()
                yield STREAM_END.encode()
        finally:
            await self._release(b, resp, outcome)

    async def _release(self, b: Backend, resp, outcome: str) -> None:
        """A relayed stream is over: its backend response closed, the backend's count and outcome kept."""
        await resp.aclose()
        b.in_flight -= 1
        self.metrics.in_flight.labels(b.id).set(b.in_flight)
        self.metrics.requests.labels(b.id, outcome).inc()

    def _failed(self, b: Backend, why: str) -> None:
        """An attempt that failed before its first byte reached the client (the request moves on)."""
        self._set_alive(b, False, why)
        self.metrics.requests.labels(b.id, "failed").inc()
