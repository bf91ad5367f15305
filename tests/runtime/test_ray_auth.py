"""Ray's authentication as hetserve sets it before starting or joining Ray (no Ray started here)."""

from __future__ import annotations

import logging

import pytest

from hetserve.runtime.workers.ray_session import ray_auth_env


@pytest.fixture(autouse=True)
def _no_default_token_file(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # ~/.ray/auth_token absent


def test_a_private_ray_gets_a_fresh_token_by_default():
    """Ray turns token authentication on where the mode is unset and a token is at hand."""
    env = ray_auth_env({}, joining=False)
    assert set(env) == {"RAY_AUTH_TOKEN"} and len(env["RAY_AUTH_TOKEN"]) == 64
    assert ray_auth_env({}, joining=False)["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]
    assert ray_auth_env({"RAY_AUTH_MODE": "token"}, joining=False)  # a token for the mode asked for


def test_joining_a_pool_needs_its_token_and_says_where_to_put_it(tmp_path):
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN_PATH.*docs/multinode.md"):
        ray_auth_env({}, joining=True)
    assert ray_auth_env({"RAY_AUTH_TOKEN_PATH": "/etc/ray/token"}, joining=True) == {}
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert ray_auth_env({"RAY_AUTH_MODE": "token"}, joining=True) == {}


def test_auth_turned_off_is_honoured_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert ray_auth_env({"RAY_AUTH_MODE": "disabled"}, joining=True) == {}
    assert "run code on every node" in caplog.text
