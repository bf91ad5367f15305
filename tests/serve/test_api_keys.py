"""The HTTP API behind keys: Bearer API keys on every route but the probes, a separate admin key for
/admin/* (off without one), constant-time checks, and where keys come from (options, environment,
owner-only key files), against the in-process fake engine; ``hetserve serve`` itself behind keys is
``tests/serve/test_cli_serve.py``'s end-to-end test."""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from hetserve.cli.main import main as cli
from hetserve.serve.keys import APIAuth, KeyConfigError, KeySet, bearer_token, keys_from, read_key_file

KEY, OTHER_KEY, ADMIN_KEY = "sk-test-one", "sk-test-two", "adm-secret"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
# every /v1 route, streamed and not
V1_CALLS = [("POST", "/v1/completions", COMPLETION), ("POST", "/v1/completions", {**COMPLETION, "stream": True}),
            ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
            ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None)]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def call(url: str, method: str, path: str, body=None, headers=None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=30)


def keyed(serve_fake, keys=(KEY,), admin=(), protect_probes=False):
    return serve_fake(auth=APIAuth(api_keys=KeySet(keys), admin_keys=KeySet(admin), protect_probes=protect_probes))


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.request.url, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
    for secret in (KEY, OTHER_KEY, ADMIN_KEY, "wrong-key"):
        assert secret not in r.text  # the answer never repeats a key, right or wrong


# ---------------------------------------------------------------------------------------------- /v1/*

@pytest.mark.parametrize("method,path,body", V1_CALLS)
def test_no_key_or_a_wrong_key_gets_401_and_reaches_no_replica(serve_fake, method, path, body):
    url, backend, _ = keyed(serve_fake)
    for headers in (None, bearer("wrong-key"), bearer(KEY + "x"), bearer(KEY[:-1]), {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}, bearer(ADMIN_KEY)):
        assert_401(call(url, method, path, body, headers))
    assert backend.placed == []  # refused before the body was read: nothing was generated
    assert call(url, method, path, body, bearer(KEY)).status_code == 200


def test_the_right_key_works_with_the_openai_client_and_a_wrong_one_is_an_authentication_error(serve_fake):
    url, _, _ = keyed(serve_fake)
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=4, seed=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcd"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert chat.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="tiny", prompt="hello", max_tokens=4, stream=True)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_each_of_several_keys_works(serve_fake):
    url, _, _ = keyed(serve_fake, keys=(KEY, OTHER_KEY))
    for key in (KEY, OTHER_KEY):
        assert call(url, "POST", "/v1/completions", COMPLETION, bearer(key)).status_code == 200
        assert call(url, "POST", "/v1/completions", COMPLETION, {"Authorization": f"bearer  {key}"}).status_code == 200
    assert_401(call(url, "POST", "/v1/completions", COMPLETION, bearer(KEY + OTHER_KEY)))


def test_unauthorized_requests_are_counted_in_metrics(serve_fake):
    url, _, _ = keyed(serve_fake)
    for _ in range(3):
        assert_401(call(url, "POST", "/v1/chat/completions", CHAT))
    assert_401(call(url, "GET", "/v1/models", headers=bearer("wrong-key")))
    text = httpx.get(url + "/metrics").text
    assert 'hetserve_requests_total{endpoint="chat",outcome="unauthorized"} 3.0' in text
    assert 'hetserve_requests_total{endpoint="other",outcome="unauthorized"} 1.0' in text


def test_without_keys_the_api_stays_open(serve_fake):
    url, _, _ = serve_fake()
    for method, path, body in V1_CALLS:
        assert call(url, method, path, body).status_code == 200


def test_every_route_of_the_app_is_guarded(fake_backend):
    """A route added later is behind the key too: every route of the app but the probes answers 401
    without a key (the admin ones as well, with their own key)."""
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.fake import ByteCodec
    from hetserve.serve.server import ServerThread

    app = create_app(Coordinator(fake_backend, ByteCodec(), "tiny"),
                     auth=APIAuth(api_keys=KeySet([KEY]), admin_keys=KeySet([ADMIN_KEY])))

    @app.get("/added-later")
    async def added_later():
        return {"ok": True}

    seen = 0
    with ServerThread(app) as srv:
        for route in app.routes:
            if not hasattr(route, "methods") or route.path in ("/health", "/metrics"):
                continue
            path = re.sub(r"\{[^}]*\}", "tiny", route.path)
            for method in route.methods - {"HEAD"}:
                assert_401(call(srv.url, method, path))
                seen += 1
        assert call(srv.url, "GET", "/added-later", headers=bearer(KEY)).json() == {"ok": True}
    assert seen >= 6


# ---------------------------------------------------------------------------------------------- admin

def test_admin_is_off_without_an_admin_key(serve_fake):
    for keys in ((), (KEY,)):
        url, _, _ = keyed(serve_fake, keys=keys)
        for headers in (None, bearer(KEY), bearer(ADMIN_KEY)):
            r = call(url, "POST", "/admin/replan", {}, headers)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_admin_needs_its_own_key(serve_fake):
    url, _, _ = keyed(serve_fake, admin=(ADMIN_KEY,))
    for headers in (None, bearer("wrong-key"), bearer(KEY), bearer(ADMIN_KEY[:-1])):
        assert_401(call(url, "POST", "/admin/replan", {}, headers))  # an API key does not open admin
    r = call(url, "POST", "/admin/replan", {}, bearer(ADMIN_KEY))  # past the key: the fake cannot re-plan
    assert r.status_code == 400 and "cannot re-plan" in r.json()["error"]["message"]
    assert_401(call(url, "POST", "/v1/completions", COMPLETION, bearer(ADMIN_KEY)))  # nor the admin key /v1
    text = httpx.get(url + "/metrics").text
    assert 'hetserve_requests_total{endpoint="admin",outcome="unauthorized"} 4.0' in text


def test_admin_key_alone_leaves_the_api_open(serve_fake):
    url, _, _ = keyed(serve_fake, keys=(), admin=(ADMIN_KEY,))
    assert call(url, "POST", "/v1/completions", COMPLETION).status_code == 200
    assert_401(call(url, "POST", "/admin/replan", {}))


# ---------------------------------------------------------------------------------------------- probes

def test_probes_are_open_by_default_and_closed_with_protect_probes(serve_fake):
    url, _, _ = keyed(serve_fake)
    for path in ("/health", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    url, _, _ = keyed(serve_fake, protect_probes=True)
    for path in ("/health", "/metrics"):
        assert_401(httpx.get(url + path))
        assert_401(httpx.get(url + path, headers=bearer("wrong-key")))
        assert httpx.get(url + path, headers=bearer(KEY)).status_code == 200


# ---------------------------------------------------------------------------------------------- keys

def test_keyset_compares_every_key_in_constant_time(monkeypatch):
    """Every configured digest is compared, with hmac.compare_digest over SHA-256 digests (the same
    length whatever the key's), whichever key matches and whether any does."""
    import hmac

    from hetserve.serve import keys as keys_mod

    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(keys_mod.hmac, "compare_digest", spy)
    ks = KeySet(["a", "bb" * 40, "ccc"])
    for token, ok in (("a", True), ("ccc", True), ("bb" * 40, True), ("zz", False), (None, False), ("", False)):
        calls.clear()
        assert ks.matches(token) is ok
        assert calls == [(32, 32)] * 3, token
    assert "a" not in repr(ks) and repr(ks) == "KeySet(3 keys)"
    with pytest.raises(TypeError):
        KeySet("one-string")


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer   abc ") == "abc"
    for header in (None, "", "abc", "Basic abc", "Bearer", "Bearer   ", "Token abc"):
        assert bearer_token(header) is None


def test_option_keys_win_over_the_environment_and_the_variable_takes_several():
    env = {"HETSERVE_API_KEY": f" {KEY} ,{OTHER_KEY},,"}
    assert keys_from(None, None, "HETSERVE_API_KEY", "--api-key", environ=env) == [KEY, OTHER_KEY]
    assert keys_from(["opt-key"], None, "HETSERVE_API_KEY", "--api-key", environ=env) == ["opt-key"]
    assert keys_from(None, None, "HETSERVE_API_KEY", "--api-key", environ={}) == []
    with pytest.raises(KeyConfigError, match="HETSERVE_API_KEY is set but holds no key"):
        keys_from(None, None, "HETSERVE_API_KEY", "--api-key", environ={"HETSERVE_API_KEY": " , "})
    with pytest.raises(KeyConfigError, match="printable ASCII"):
        keys_from(["has space"], None, "HETSERVE_API_KEY", "--api-key", environ={})


def test_a_key_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# serving keys\n{KEY}\n\n{OTHER_KEY}\n")
    path.chmod(0o644)
    with pytest.raises(KeyConfigError) as info:
        read_key_file(str(path))
    assert str(path) in str(info.value) and "0644" in str(info.value) and "chmod 600" in str(info.value)
    path.chmod(0o600)
    assert read_key_file(str(path)) == [KEY, OTHER_KEY]
    assert keys_from(None, [str(path)], "HETSERVE_API_KEY", "--api-key", environ={}) == [KEY, OTHER_KEY]
    (tmp_path / "empty.txt").write_text("# none\n")
    (tmp_path / "empty.txt").chmod(0o600)
    with pytest.raises(KeyConfigError, match="holds no key"):
        read_key_file(str(tmp_path / "empty.txt"))


# ---------------------------------------------------------------------------------------------- the CLI

PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}


@pytest.fixture
def serve_inputs(tmp_path):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=32, heads=2, max_positions=4096)
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    return ["serve", "--plan", str(plan), "--cluster", "demo-cpu", "--model", str(model)]


@pytest.fixture
def captured_options(monkeypatch):
    """``hetserve serve`` stops where the workers would start; the options it built are kept."""
    from hetserve.serve import launch

    seen = []

    def no_build(opts):
        seen.append(opts)
        raise KeyConfigError("stopped before any worker started")

    monkeypatch.setattr(launch, "build", no_build)
    return seen


def test_cli_reads_keys_from_options_files_and_the_environment(serve_inputs, captured_options, monkeypatch,
                                                                tmp_path, capsys):
    monkeypatch.setenv("HETSERVE_API_KEY", f"{KEY},{OTHER_KEY}")
    monkeypatch.setenv("HETSERVE_ADMIN_KEY", ADMIN_KEY)
    assert cli(serve_inputs + ["--port", "0"]) == 2
    opts = captured_options[-1]
    assert opts.api_keys == (KEY, OTHER_KEY) and opts.admin_keys == (ADMIN_KEY,) and not opts.protect_probes
    assert "HETSERVE_API_KEY" not in os.environ and "HETSERVE_ADMIN_KEY" not in os.environ  # workers inherit none
    assert KEY not in repr(opts) and ADMIN_KEY not in repr(opts)

    monkeypatch.setenv("HETSERVE_API_KEY", KEY)
    keyfile = tmp_path / "k.txt"
    keyfile.write_text("from-file\n")
    keyfile.chmod(0o600)
    assert cli(serve_inputs + ["--port", "0", "--api-key", "from-option", "--api-key-file", str(keyfile),
                               "--protect-probes"]) == 2
    opts = captured_options[-1]
    assert opts.api_keys == ("from-option", "from-file") and opts.admin_keys == () and opts.protect_probes
    capsys.readouterr()


@pytest.mark.parametrize("extra,words", [
    (["--api-key-file", "{open}"], ["{open}", "0644"]),
    (["--protect-probes"], ["--protect-probes", "API key"]),
    (["--api-key", "same", "--admin-key", "same"], ["--admin-key", "not also an API key"]),
    (["--tls-cert", "{open}"], ["--tls-key", "--tls-ca", "all three"]),
    (["--tls-cert", "{open}", "--tls-key", "{open}", "--tls-ca", "{missing}"], ["--tls-ca", "{missing}"]),
])
def test_cli_refuses_unsafe_key_and_tls_options_before_any_worker_starts(serve_inputs, captured_options, tmp_path,
                                                                        capsys, monkeypatch, extra, words):
    monkeypatch.delenv("HETSERVE_API_KEY", raising=False)
    open_file = tmp_path / "open-keys.txt"
    open_file.write_text("k\n")
    open_file.chmod(0o644)
    subst = {"{open}": str(open_file), "{missing}": str(tmp_path / "missing.pem")}
    extra = [subst.get(a, a) for a in extra]
    assert cli(serve_inputs + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for w in words:
        assert subst.get(w, w) in err[0], err
    assert captured_options == []


@pytest.mark.slow
def test_cli_hands_the_tls_files_to_the_engine(serve_inputs, captured_options, tmp_path, capsys):
    """--tls-cert/--tls-key/--tls-ca become the engine's ``tls`` option (the runtime's ``TLSFiles``);
    without them the engine gets none."""
    from hetserve.runtime.workers.auth import TLSFiles

    files = {}
    for what in ("cert", "key", "ca"):
        files[what] = tmp_path / f"{what}.pem"
        files[what].write_text("-----BEGIN PLACEHOLDER-----\n")
        files[what].chmod(0o600)
    assert cli(serve_inputs + ["--port", "0", "--tls-cert", str(files["cert"]), "--tls-key", str(files["key"]),
                               "--tls-ca", str(files["ca"])]) == 2
    tls = captured_options[-1].engine_options["tls"]
    assert isinstance(tls, TLSFiles)
    assert (tls.cert, tls.key, tls.ca) == (str(files["cert"]), str(files["key"]), str(files["ca"]))
    assert cli(serve_inputs + ["--port", "0"]) == 2
    assert "tls" not in captured_options[-1].engine_options
    capsys.readouterr()
