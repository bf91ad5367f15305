"""``SharedLinks`` re-decides a queue that sends all it holds by appending new messages and
dropping finished ones; that must be the allocation ``SenderQueue.replan`` builds, and the
queue's flow classes and resource index must follow it."""

from __future__ import annotations

import random

import pytest

from hetserve.policies.links import fifo_key
from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim.links import SharedLinks
from hetserve.specs.cluster import load_cluster


def _check(model: SharedLinks) -> None:
    for q in model.queues.values():
        st = q.sharing
        expected = sorted(q.pending.values(), key=fifo_key)
        assert [s[0] for s in q.sends] == expected
        assert all(s[1] == s[0].remaining for s in q.sends)
        classes: dict[tuple, int] = {}
        for m in expected:
            classes[m.path.names] = classes.get(m.path.names, 0) + m.copies
        assert list(st.classes.items()) == list(classes.items())
        assert st.keys == set().union(*classes)
        for k in st.keys:
            assert st in model._on_res[k]


@pytest.mark.parametrize("seed", [1, 2])
def test_sends_follow_the_replan(seed):
    cluster = load_cluster("hexgen2-het3")
    model = SharedLinks(TRANSMISSION_POLICIES["fair"])
    rng, n, now, mid = random.Random(seed), len(cluster), 0.0, 0
    for _ in range(300):
        now += rng.expovariate(100.0)
        while (t := model.next_event_s()) is not None and t <= now:
            model.advance(t)
            _check(model)
        items = []
        for _ in range(rng.randint(1, 4)):
            a, b = rng.sample(range(n), 2)
            mid += 1
            items.append((mid, "kv", cluster.path(a, b), rng.choice((2e4, 3e6, 4e7))))
        if rng.random() < 0.3:
            items.reverse()  # ids out of order: the queue re-decides from scratch
        model.put_many(items, now)
        _check(model)
    while (t := model.next_event_s()) is not None:
        model.advance(t)
        _check(model)
    assert all(not q.pending for q in model.queues.values())
