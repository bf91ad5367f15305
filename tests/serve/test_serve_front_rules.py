"""The HTTP front's rules a new user meets first, over the in-process fake engine: the key check on
every path before routing, ``max_model_len`` as a request can use it, how a drain's refusals are
logged, bodies read as JSON whatever their Content-Type, a re-plan error naming its field, and a
stop string that shows only in the text flushed at the end."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from hetserve.serve.fake import ByteCodec, FakeBackend
from hetserve.serve.keys import APIAuth, KeySet

KEY, ADMIN = "sk-front", "adm-front"


def _is_401(r: httpx.Response) -> bool:
    return (r.status_code == 401 and r.headers.get("www-authenticate") == "Bearer"
            and r.json()["error"]["code"] == "invalid_api_key")


def test_without_a_key_every_v1_path_and_method_is_401_before_routing(serve_fake):
    """No route, no method, no other path tells a caller without a key what exists: all 401 (and
    counted as unauthorized); with the key the router answers 404 / 405 as before."""
    url, _, coord = serve_fake(auth=APIAuth(api_keys=KeySet([KEY]), admin_keys=KeySet([ADMIN])))
    asks = [("GET", "/v1/nope"), ("POST", "/v1/nope/deeper"), ("OPTIONS", "/v1/models"), ("DELETE", "/v1/completions"),
            ("PUT", "/v1/models/tiny"), ("GET", "/v1"), ("GET", "/nope")]
    for method, path in asks:
        assert _is_401(httpx.request(method, url + path)), (method, path)
        assert _is_401(httpx.request(method, url + path, headers={"Authorization": "Bearer wrong"})), (method, path)
    assert _is_401(httpx.get(url + "/admin/nope"))  # admin paths: the admin key, known route or not
    assert _is_401(httpx.get(url + "/admin/nope", headers={"Authorization": f"Bearer {KEY}"}))
    counted = coord.metrics.render()[0].decode()
    assert 'outcome="unauthorized"' in counted
    with_key = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/v1/nope", headers=with_key).status_code == 404
    assert httpx.options(url + "/v1/models", headers=with_key).status_code == 405
    assert httpx.get(url + "/v1/models", headers=with_key).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # the probes stay open


def test_admin_paths_do_not_exist_without_an_admin_key(serve_fake):
    url, _, _ = serve_fake(auth=APIAuth(api_keys=KeySet([KEY])))
    for path in ("/admin/replan", "/admin/nope"):
        r = httpx.post(url + path, json={}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path


@pytest.mark.parametrize("pool,advertised", [(100, 100), (100_000, 256)])
def test_max_model_len_is_what_a_request_can_use(serve_fake, pool, advertised):
    """The model's context (256) capped by the largest live KV pool: a request must fit one."""
    url, _, _ = serve_fake(FakeBackend(max_context=256, kv_capacity=pool))
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == advertised
    assert httpx.get(url + "/v1/models/tiny").json()["max_model_len"] == advertised


def test_a_drains_503_is_one_warning_line_not_an_error(serve_fake, caplog):
    url, _, coord = serve_fake()
    coord.draining = True
    with caplog.at_level(logging.INFO, logger="hetserve.serve"):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"]
    mine = [rec for rec in caplog.records if rec.name == "hetserve.serve"]
    assert [rec.levelno for rec in mine] == [logging.WARNING] and not mine[0].exc_info
    assert "503 shutting_down" in mine[0].getMessage()


@pytest.mark.parametrize("raised", ["ServerError", "Overloaded"])
def test_a_plain_request_the_shutdown_ends_is_503_with_retry_after_whatever_the_backend_raises(serve_fake, raised):
    """The engine's backend says a shutdown ended a request with ``Overloaded``, the fake with a fault:
    either way, while draining, the answer is the server's refusal with ``Retry-After``."""
    from hetserve.serve import errors

    holder = {}

    class EndedByShutdown(FakeBackend):
        async def generate(self, request_id, prompt_token_ids, params, replica=None, *, share_with=None):
            holder["coord"].draining = True  # the shutdown began while this request ran
            raise getattr(errors, raised)("ended by a second signal")
            yield  # an async generator, as a backend's generate is

    url, _, coord = serve_fake(EndedByShutdown())
    holder["coord"] = coord
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    assert r.headers["retry-after"]


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_its_content_type(serve_fake, ctype):
    url, _, _ = serve_fake()
    headers = {"Content-Type": ctype} if ctype else {}
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    r = httpx.post(url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_replan_naming_an_unknown_device_names_the_field(serve_fake):
    """``returned`` (or ``lost``) naming a device the cluster lacks: 400 with that field as param."""
    from hetserve.serve.replan import Replanner
    from hetserve.specs.cluster import load_cluster

    class Engine:
        cluster = load_cluster("demo-tiny")

        def stats(self):
            return {"replicas": {}, "deaths": []}

    url, _, coord = serve_fake(auth=APIAuth(admin_keys=KeySet([ADMIN])))
    coord.replanner = Replanner(Engine())
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for field in ("returned", "lost"):
        r = httpx.post(url + "/admin/replan", json={field: ["m9:9"]}, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "m9:9" in r.json()["error"]["message"]


class _Bytes:
    """A backend yielding fixed byte tokens: text that ends in partial characters until the end."""

    max_context = 256

    def __init__(self, tokens):
        self.tokens = tokens

    async def generate(self, request_id, prompt_token_ids, params, replica=None, **_):
        for t in self.tokens:
            yield t

    def abort(self, request_id):
        pass

    def replicas(self):
        return []


def test_a_stop_string_seen_only_in_the_flushed_tail_finishes_with_stop():
    """0xFF 0x06 then bytes that never complete a character: the stop string U+FFFD U+FFFD shows only
    when the held-back bytes are flushed; the text is cut there and the finish reason is "stop"."""
    from hetserve.serve.coordinator import Coordinator

    coord = Coordinator(_Bytes([0xFF, 0x06, 0xFF, 0xFF, 0xE2]), ByteCodec(), "tiny")
    req = coord.prepare("completions", [72], max_tokens=5, default_max_tokens=None, temperature=0.0, top_p=1.0,
                        seed=None, stop=["\ufffd\ufffd"], ignore_eos=True)

    async def run() -> str:
        return "".join([d async for d in coord.run(req)])

    assert asyncio.run(run()) == req.text == "\ufffd\x06"
    assert req.finish_reason == "stop"
