"""What ``hetserve route`` refuses at start (a hetserve bundle, an engine export never writes, one
server named twice, a backend URL with a path, an empty ``--backends`` entry) and what it says when
a backend refuses its credentials or fails its health check: the operator reads why in the log, the
client a 502 about the router."""

import asyncio
import json
import logging

import httpx
import pytest

from hetserve.errors import SpecError
from hetserve.serve.route.app import Router
from hetserve.serve.route.backends import (Backend, BackendPool, RouteConfig, config_from_backends_option,
                                           config_from_deploy, config_from_urls)


def write_deploy(tmp_path, engine, endpoints, roles=None):
    """A deploy.json as ``hetserve export`` writes one: replicas r0.. on ``endpoints``."""
    roles = roles or ["colocated"] * len(endpoints)
    data = {"engine": engine, "engine_version": "x", "plan": "plan.json",
            "replicas": [{"id": f"r{i}", "role": role, "devices": [], "launch": [], "endpoint": e}
                         for i, (e, role) in enumerate(zip(endpoints, roles))],
            "router": {"argv": [], "weights": {}, "kv_routes": [], "endpoint": "http://127.0.0.2:8000"}}
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps(data))
    return path


def test_a_hetserve_bundle_is_refused_naming_its_own_endpoint(tmp_path):
    # as `hetserve export --to hetserve` writes it: every replica behind the one server
    path = write_deploy(tmp_path, "hetserve", ["http://127.0.0.2:8000"] * 2, ["prefill", "decode"])
    with pytest.raises(SpecError) as err:
        config_from_deploy(path)
    msg = str(err.value)
    assert str(path) in msg and "field 'engine'" in msg and "routes between its replicas itself" in msg, msg
    assert "http://127.0.0.2:8000" in msg and "\n" not in msg


@pytest.mark.parametrize("engine", ["trt", "VLLM", "", None, 3])
def test_an_engine_export_never_writes_is_refused_naming_those_it_does(tmp_path, engine):
    path = write_deploy(tmp_path, engine, ["http://127.0.0.1:8001"])
    with pytest.raises(SpecError) as err:
        config_from_deploy(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: field 'engine': expected vllm or sglang (") and f"got {'null' if engine is None else engine!r}" in msg, msg
    for known in ("vllm", "sglang"):  # what export writes for them is read
        assert config_from_deploy(write_deploy(tmp_path, known, ["http://127.0.0.1:8001"])).backends[0].id == "r0"


def test_two_replicas_on_one_endpoint_are_refused(tmp_path):
    path = write_deploy(tmp_path, "vllm", ["http://127.0.0.1:8001", "http://127.0.0.1:8001/"], ["prefill", "decode"])
    with pytest.raises(SpecError) as err:
        config_from_deploy(path)
    assert "replicas.1.endpoint" in str(err.value) and "r0 has it" in str(err.value)
    ok = write_deploy(tmp_path, "vllm", ["http://127.0.0.1:8001", "http://127.0.0.1:8002"], ["prefill", "decode"])
    assert [b.url for b in config_from_deploy(ok).backends] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize("url, drop", [("http://127.0.0.1:8000/v1", "/v1"), ("http://h:1/v1/", "/v1"),
                                       ("http://h:1?x=1", "?x=1")])
def test_a_backend_url_with_a_path_is_refused_with_the_fix(tmp_path, url, drop):
    with pytest.raises(SpecError) as err:
        config_from_urls([url])
    assert "--backends" in str(err.value) and f"drop {drop}" in str(err.value), str(err.value)
    with pytest.raises(SpecError, match="replicas.0.endpoint"):
        config_from_deploy(write_deploy(tmp_path, "vllm", [url]))
    assert config_from_urls(["http://h:1/"]).backends[0].url == "http://h:1"  # a bare trailing slash is no path


@pytest.mark.parametrize("url", ["http://user:s3cret@127.0.0.1:8100", "https://s3cret@h:1"])
def test_a_backend_url_with_credentials_is_refused_without_repeating_them(tmp_path, url):
    with pytest.raises(SpecError) as err:
        config_from_urls([url])
    assert "user:password" in str(err.value) and "s3cret" not in str(err.value), str(err.value)
    with pytest.raises(SpecError, match="replicas.0.endpoint") as err:
        config_from_deploy(write_deploy(tmp_path, "vllm", [url]))
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("router, field", [([1], "router"), ({"weights": [1]}, "router.weights")])
def test_a_router_or_weights_of_the_wrong_type_is_named(tmp_path, router, field):
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"engine": "vllm", "router": router, "replicas": [
        {"id": "a", "role": "colocated", "endpoint": "http://127.0.0.1:9"}]}))
    with pytest.raises(SpecError) as err:
        config_from_deploy(path)
    assert err.value.field == field and str(path) in str(err.value)


@pytest.mark.parametrize("text", ["http://a:1,,http://b:2", "http://a:1,", ", http://a:1"])
def test_an_empty_backends_entry_is_refused(text):
    with pytest.raises(SpecError) as err:
        config_from_backends_option(text)
    assert str(err.value).startswith("--backends: expected a URL at every position"), str(err.value)
    assert len(config_from_backends_option("http://a:1, http://b:2").backends) == 2


BACKEND_401 = {"error": {"message": "You didn't provide an API key.", "type": "invalid_request_error"}}


def router_on(handler, **kw) -> tuple[Router, Backend]:
    b0 = Backend("b0", "colocated", "http://b0")
    router = Router(BackendPool(RouteConfig((b0,))), health_interval_s=0, **kw)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return router, b0


@pytest.mark.parametrize("status", [401, 403])
def test_a_backend_refusing_routes_credentials_is_a_502_about_the_router_logged_once(caplog, status):
    from fastapi.testclient import TestClient

    from hetserve.serve.route.server import create_app

    router, b0 = router_on(lambda request: httpx.Response(status, json=BACKEND_401))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with caplog.at_level(logging.WARNING, logger="hetserve.serve.route"), TestClient(create_app(router)) as client:
        answers = [client.post("/v1/completions", json=body),
                   client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                          "content": "hi"}]}),
                   client.post("/v1/completions", json={**body, "stream": True}),
                   client.get("/v1/models")]
    for r in answers:
        error = r.json()["error"]
        assert r.status_code == 502 and error["code"] == "backend_refused_credentials", r.text
        assert "refused this router's credentials" in error["message"] and "API key" not in error["message"]
    told = [r.getMessage() for r in caplog.records if "--backend-api-key-file" in r.getMessage()]
    assert len(told) == 1 and "b0" in told[0] and f"HTTP {status}" in told[0], told
    assert b0.alive  # the backend is up: it is route's key that is wrong


def test_a_wrong_backend_key_is_told_as_such():
    router, b0 = router_on(lambda request: httpx.Response(401, json=BACKEND_401), api_key="stale")
    assert "the key in --backend-api-key-file is not one it takes" in router.credentials_refused(b0, 401)
    asyncio.run(router.close())


@pytest.mark.parametrize("answer, why", [
    (lambda request: httpx.Response(401, json=BACKEND_401),
     "answered HTTP 401 (it refuses route's credentials: give route the backends' key with --backend-api-key-file)"),
    (lambda request: httpx.Response(404, json={}), "GET /health answered HTTP 404"),
    (lambda request: (_ for _ in ()).throw(httpx.ConnectError("Connection refused", request=request)),
     "connection failed (Connection refused)"),
])
def test_a_backend_taken_out_by_its_health_check_is_logged_with_why(caplog, answer, why):
    router, b0 = router_on(answer, health_failures=2)

    async def checks():
        for _ in range(2):
            await router.check(b0)
        await router.close()

    with caplog.at_level(logging.WARNING, logger="hetserve.serve.route"):
        asyncio.run(checks())
    downs = [r.getMessage() for r in caplog.records if "is down" in r.getMessage()]
    assert not b0.alive and len(downs) == 1 and why in downs[0], downs


def test_a_deploy_json_without_replicas_says_the_field_is_missing_and_names_the_unknown_ones(tmp_path, caplog):
    path = tmp_path / "deploy.json"
    path.write_text(json.dumps({"backends": 3}))
    with pytest.raises(SpecError) as err:
        config_from_deploy(path)
    msg = str(err.value)
    assert "field 'replicas'" in msg and "missing" in msg and "'backends'" in msg, msg
    assert "NoneType" not in msg and "\n" not in msg
    # a file that serves but carries a typo'd field: the field is named in a warning, not dropped unseen
    good = json.loads(write_deploy(tmp_path, "vllm", ["http://127.0.0.2:8001"]).read_text())
    path.write_text(json.dumps({**good, "routr": {}}))
    with caplog.at_level(logging.WARNING, logger="hetserve.serve.route.backends"):
        config_from_deploy(path)
    assert any("'routr'" in r.getMessage() for r in caplog.records), caplog.records


def _pd_deploy(tmp_path, **router):
    """A P/D deploy.json (p0 -> d0, c0 colocated) with ``router`` fields replaced; its path."""
    path = write_deploy(tmp_path, "vllm", ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"],
                        ["prefill", "decode", "colocated"])
    data = json.loads(path.read_text())
    for r, rid in zip(data["replicas"], ("p0", "d0", "c0")):
        r["id"] = rid
    data["router"].update({"weights": {"p0": 0.75, "c0": 0.25},
                           "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}], **router})
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("router, field, words", [
    ({"kv_routes": [{"from": "p0", "to": "c0", "weight": 1.0}]}, "router.kv_routes.0.to", "a decode replica (d0)"),
    ({"kv_routes": [{"from": "p0", "to": "zz", "weight": 1.0}]}, "router.kv_routes.0.to", "a decode replica"),
    ({"kv_routes": [{"from": "d0", "to": "d0", "weight": 1.0}]}, "router.kv_routes.0.from", "a prefill replica (p0)"),
    ({"kv_routes": [{"from": ["p0"], "to": "d0", "weight": 1.0}]}, "router.kv_routes.0.from", "a prefill replica"),
    ({"kv_routes": [{"from": "p0", "to": "d0", "weight": -1}]}, "router.kv_routes.0.weight", "0 or more"),
    ({"kv_routes": [{"from": "p0", "to": "d0"}]}, "router.kv_routes.0", "{from, to, weight}"),
    ({"weights": {"p0": 1.0}}, "router.weights", "none for c0"),
    ({"weights": {"p0": 0.5, "c0": 0.5, "x9": 1.0}}, "router.weights.x9", "a prefill or colocated replica"),
    ({"weights": {"p0": 0.5, "c0": 0.5, "d0": 1.0}}, "router.weights.d0", "a prefill or colocated replica"),
    ({"weights": {"p0": 0, "c0": 0}}, "router.weights", "at least one weight above 0"),
])
def test_a_deploy_json_whose_router_would_send_requests_elsewhere_is_refused(tmp_path, router, field, words):
    """Mistakes in the router's weights and KV routes that would change where requests go (a decode
    half handed to a colocated server, a replica's share silently 1) are named, not taken."""
    assert [b.id for b in config_from_deploy(_pd_deploy(tmp_path)).backends] == ["p0", "d0", "c0"]
    with pytest.raises(SpecError) as err:
        config_from_deploy(_pd_deploy(tmp_path, **router))
    assert f"field '{field}'" in str(err.value) and words in str(err.value), str(err.value)


def test_a_deploy_json_replica_with_an_empty_id_is_refused(tmp_path):
    path = write_deploy(tmp_path, "vllm", ["http://127.0.0.1:8001"])
    data = json.loads(path.read_text())
    data["replicas"][0]["id"] = ""
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match="replicas.0.id.*a non-empty string"):
        config_from_deploy(path)
