"""Fixtures for the serving tests: HTTP servers over the in-process fake engine (``hetserve.serve.fake``)."""

from __future__ import annotations

import os
import time

import pytest

from hetserve.serve.fake import ByteCodec, FakeBackend

@pytest.fixture
def fake_backend():
    return FakeBackend()


@pytest.fixture
def serve_fake():
    """``serve_fake(backend=None, placement=None, codec=None, auth=None) -> (url, backend, coordinator)``
    (``auth``: a ``hetserve.serve.keys.APIAuth``); servers stop at teardown."""
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.server import ServerThread

    servers = []

    def start(backend: FakeBackend | None = None, placement=None, model_name: str = "tiny", codec=None, auth=None):
        backend = backend or FakeBackend()
        coord = Coordinator(backend, codec or ByteCodec(), model_name, placement=placement)
        srv = ServerThread(create_app(coord, auth=auth))
        servers.append(srv)
        return srv.url, backend, coord

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """Loopback traffic only: make sure no proxy setting reroutes the clients."""
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def wait_until():
    """``wait_until(cond, timeout_s, poll_s)``: poll ``cond`` until true or the (bounded) timeout."""

    def wait(cond, timeout_s: float = 10.0, poll_s: float = 0.01) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if cond():
                return True
            time.sleep(poll_s)
        return cond()

    return wait
