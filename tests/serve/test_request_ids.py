"""``x-request-id`` on every answer, as OpenAI's API sends it (its SDK reads it as ``_request_id``),
and the same id in the server's log line for an error (fake engine)."""

from __future__ import annotations

import logging
import re

import httpx
import openai
import pytest

from hetserve.serve.fake import FakeBackend
from hetserve.serve.keys import APIAuth, KeySet

FRESH = re.compile(r"req_[0-9a-f]{32}")


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_the_openai_client_reads_a_request_id_from_every_kind_of_answer(serve_fake):
    url, _, _ = serve_fake()
    c = client(url)
    done = c.completions.create(model="tiny", prompt="x", max_tokens=2)
    chat = c.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=2)
    models = c.models.with_raw_response.list()
    with c.chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True) as streamed:
        list(streamed.iter_lines())
    ids = [done._request_id, chat.request_id, models.request_id, streamed.request_id]
    assert all(i is not None and FRESH.fullmatch(i) for i in ids), ids
    assert len(set(ids)) == 4  # one per request


def test_a_usable_client_id_comes_back_and_an_unusable_one_is_replaced(serve_fake):
    url, _, _ = serve_fake()
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "trace-42/a.b"})
    assert r.headers["x-request-id"] == "trace-42/a.b"
    for bad in ("has space", "x" * 129, ""):
        r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": bad})
        assert FRESH.fullmatch(r.headers["x-request-id"]), (bad, r.headers["x-request-id"])


@pytest.fixture
def warnings_of_serve():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, logger = Keep(level=logging.WARNING), logging.getLogger("hetserve.serve")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_errors_carry_the_id_and_their_log_line_names_it(serve_fake, warnings_of_serve):
    url, _, _ = serve_fake()
    c = client(url)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=9)
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    ids = [bad.value.request_id, missing.value.request_id]
    assert all(i and FRESH.fullmatch(i) for i in ids), ids
    logged = [r.getMessage() for r in warnings_of_serve]
    for rid in ids:
        assert [line for line in logged if rid in line], (rid, logged)


def test_a_401_from_the_key_check_carries_the_id(serve_fake):
    url, _, _ = serve_fake(auth=APIAuth(api_keys=KeySet(["right"])))
    with pytest.raises(openai.AuthenticationError) as refused:
        client(url, key="wrong").models.list()
    assert FRESH.fullmatch(refused.value.request_id or "")


def test_an_unexpected_failure_is_answered_in_openais_shape_with_the_id(serve_fake):
    class Broken(FakeBackend):
        async def generate(self, request_id, prompt_token_ids, params, replica=None):
            raise RuntimeError("worker 3 died")
            yield  # an async generator

    url, _, _ = serve_fake(backend=Broken())
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5},
                   headers={"X-Request-Id": "mine-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "mine-1"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "worker 3 died" in r.json()["error"]["message"]


def test_hetserve_route_answers_with_an_id_and_hands_it_to_the_backend():
    from fastapi.testclient import TestClient

    from hetserve.serve.route.app import Router
    from hetserve.serve.route.backends import Backend, BackendPool, RouteConfig
    from hetserve.serve.route.server import create_app

    seen = []

    def backend(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-request-id"))
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion", "choices": []})

    router = Router(BackendPool(RouteConfig((Backend("b0", "colocated", "http://b0"),))), health_interval_s=0)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(backend))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with TestClient(create_app(router)) as route:
        mine = route.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
        fresh = route.post("/v1/completions", json=body)
    assert mine.status_code == fresh.status_code == 200, (mine.text, fresh.text)
    assert mine.headers["x-request-id"] == "trace-7" and FRESH.fullmatch(fresh.headers["x-request-id"])
    assert seen == ["trace-7", fresh.headers["x-request-id"]]
