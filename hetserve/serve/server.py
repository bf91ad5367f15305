"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests, bench).

``bind_socket(host, port)`` takes the address before anything starts (port 0: the OS picks one, and
the socket knows which); ``serve_forever(app, sock)`` serves ``hetserve serve``'s app on it,
``serve_plain(app, sock, requests)`` another app (``hetserve route``'s): both with the same drain.
``ServerThread(app, host, port=0)`` binds (port 0: the OS picks a free one), starts serving on its
own thread and event loop, and exposes ``url``; ``stop()`` shuts it down and joins. It is a
context manager.
"""

from __future__ import annotations

import socket
import threading
import time

# Seconds an idle keep-alive connection stays open. It must outlast the clients' own pools: httpx (and
# so openai's client) re-uses an idle connection for 5 s, aiohttp for 15 s. Where the server's timeout
# equals the client's, the server may close a connection just as the client sends its next request
# on it, and that request fails with "Server disconnected without sending a response".
KEEP_ALIVE_S = 30


def _config(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", timeout_graceful_shutdown=5, ws="none", timeout_keep_alive=KEEP_ALIVE_S)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one, ``getsockname()`` says which) but not
    listening yet, so connections are refused, not left hanging, until the server accepts them (the
    server listens when it starts). Raises ``OSError`` (a port another server listens on, unknown host).

    Bound, the port is reserved against ordinary binds while the workers start; on Linux another
    socket with SO_REUSEADDR could still share it until this one listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_forever(app, sock: socket.socket, log_level: str = "info", drain_timeout_s: float = 30.0) -> None:
    """Serve on ``sock`` (from ``bind_socket``) until SIGTERM / Ctrl-C, then shut down gracefully: new
    requests get 503 with ``Retry-After`` while the ones in flight finish (up to ``drain_timeout_s``);
    those left end with one error event and ``[DONE]``. A second signal ends every request in flight
    at once the same way (a streamed one with an error event and ``[DONE]``, any other with an error in
    OpenAI's JSON shape) and stops once they are answered (``STOP_GRACE_S`` at most); a third stops
    without waiting, cutting whatever is still being written."""
    serve_plain(app, sock, app.state.coordinator, drain_timeout_s, log_level)


def serve_plain(app, sock: socket.socket, requests, drain_timeout_s: float = 30.0, log_level: str = "warning") -> None:
    """``serve_forever``'s serving and shutdown for any app: ``requests`` is what holds its requests in
    flight, with ``in_flight`` (a count), ``drain(timeout_s)`` (admit nothing new, wait, end those left;
    returns how many were ended) and ``end_now(reason, grace_s, poll_s)`` (end them all now), as
    ``Coordinator`` (``hetserve serve``) and ``route.app.Router`` (``hetserve route``) have."""
    host, port = sock.getsockname()[:2]
    config = _config(app, host, port, log_level)
    _draining_server(config, requests, drain_timeout_s).run(sockets=[sock])


# After a second signal: seconds the requests it ended get to write their error and close. The
# engine answers a fail-all within one step; past this, uvicorn's own shutdown cancels what is left.
STOP_GRACE_S = 3.0
SECOND_SIGNAL_REASON = "the server is shutting down: stopped by a second signal before the request finished"


def _draining_server(config, requests, drain_timeout_s: float):
    import asyncio
    import logging

    import uvicorn

    log = logging.getLogger("hetserve.serve")

    class DrainingServer(uvicorn.Server):
        _loop = None
        _signals = 0

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            # signals are counted, not re-raised at exit, so the CLI still stops the workers after any
            if self._loop is None:
                return super().handle_exit(sig, frame)  # before start-up: uvicorn's own handling
            self._signals += 1
            if self._signals == 1:
                self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))
            elif self._signals == 2:
                # not uvicorn's force_exit: that cancels the request tasks, so a client gets a bare
                # 500 or a cut stream and the log a traceback per request
                self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._stop_now()))
            else:
                self.should_exit = self.force_exit = True

        async def _stop_now(self):
            log.warning("second signal: ending %d request(s) in flight now with an error, then stopping "
                        "(a third signal stops without waiting)", requests.in_flight)
            await requests.end_now(SECOND_SIGNAL_REASON, grace_s=STOP_GRACE_S, poll_s=0.02)
            self.should_exit = True

        async def _drain(self):
            log.warning("shutting down: draining %d request(s) for up to %g s (new requests get 503)",
                        requests.in_flight, drain_timeout_s)
            cut = await requests.drain(drain_timeout_s)
            if cut:
                log.warning("drain timeout: %d request(s) ended with an error event", cut)
            self.should_exit = True

    return DrainingServer(config)


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout_s: float = 30.0):
        import uvicorn

        self.server = uvicorn.Server(_config(app, host, port, log_level))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="hetserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server failed to start on {host}:{port}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start within {start_timeout_s:.0f} s")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        self.port = int(sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
