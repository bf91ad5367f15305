"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests, bench).

``ServerThread(app, host, port=0)`` binds (port 0: the OS picks a free one), starts serving on its
own thread and event loop, and exposes ``url``; ``stop()`` shuts it down and joins. It is a
context manager.
"""

from __future__ import annotations

import threading
import time


def _config(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", timeout_graceful_shutdown=5, ws="none")


def serve_forever(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    import uvicorn

    uvicorn.Server(_config(app, host, port, log_level)).run()


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
