"""Where a request may go: only to a replica whose KV pool can ever hold it (placement would
otherwise queue it forever on a small replica while a larger one idles), and a request without
max_tokens asks for what the largest pool leaves, not the whole context."""

from __future__ import annotations

import dataclasses

import pytest

from hetserve.policies.placement import make_placement
from hetserve.serve.coordinator import Coordinator
from hetserve.serve.errors import ContextLengthExceeded
from hetserve.serve.fake import ByteCodec, FakeBackend


class Pools(FakeBackend):
    """``FakeBackend`` whose replicas have pools of their own sizes (tokens)."""

    def __init__(self, pools: dict[str, int], **kw):
        super().__init__(replicas=len(pools), **kw)
        self.pools = pools

    def replicas(self):
        return [dataclasses.replace(r, kv_capacity_tokens=self.pools[r.id]) for r in super().replicas()]


def prepared(coord: Coordinator, prompt: str, max_tokens: int | None):
    return coord.prepare("completions", coord.tokenize(prompt), max_tokens=max_tokens, default_max_tokens=None,
                         temperature=0.0, top_p=1.0, seed=None, stop=())


def test_placement_skips_a_replica_whose_pool_never_holds_the_request():
    coord = Coordinator(Pools({"r0": 64, "r1": 1024}), ByteCodec(), "tiny", placement=make_placement("rr"))
    long = [coord.place(prepared(coord, "abcd", 100)) for _ in range(4)]
    assert long == ["r1"] * 4  # round robin would have sent two of them to r0
    short = [coord.place(prepared(coord, "abcd", 8)) for _ in range(2)]
    assert sorted(short) == ["r0", "r1"]  # a request that fits both still goes round


def test_a_request_without_max_tokens_asks_for_what_the_largest_pool_leaves():
    coord = Coordinator(Pools({"r0": 64, "r1": 160}, max_context=256), ByteCodec(), "tiny")
    assert prepared(coord, "abcd", None).params.max_tokens == 160 - 4
    with pytest.raises(ContextLengthExceeded):  # asked for explicitly, it is still refused
        prepared(coord, "abcd", 200)


def test_no_live_replica_says_how_it_comes_back():
    backend = Pools({"r0": 64, "r1": 1024})
    backend.dead = {"r0", "r1"}
    coord = Coordinator(backend, ByteCodec(), "tiny")
    assert coord.unavailable().endswith("once the server is restarted")
    coord.replanner = object()  # a re-plan without an admin key: no operator can ask for it
    assert coord.unavailable().endswith("once the server is restarted")
    coord.admin_replan = True
    assert "POST /admin/replan" in coord.unavailable()
