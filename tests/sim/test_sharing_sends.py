"""``SharedLinks``' short cuts equal the plain computations: a queue that sends all it holds
re-decides by appending new messages and dropping finished ones, which must be the allocation
``SenderQueue.replan`` builds (its flow classes and the resource index following it); one class
alone on its path gets ``class_rates``' very float without a filling."""

from __future__ import annotations

import math
import random

import pytest

from hetserve.cost.network import class_rates, one_class_rate
from hetserve.policies.links import fifo_key
from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim.links import SharedLinks
from hetserve.sim.fillings import Fillings
from hetserve.specs.cluster import load_cluster
from hetserve.specs.network import Path


def _check(model: SharedLinks) -> None:
    for q in model.queues.values():
        st = q.sharing
        expected = sorted(q.pending.values(), key=fifo_key)
        assert [s.msg for s in q.sends] == expected
        assert all(s.left == s.msg.remaining for s in q.sends)
        classes: dict[tuple, int] = {}
        for m in expected:
            classes[m.path.names] = classes.get(m.path.names, 0) + m.copies
        assert list(st.classes.items()) == list(classes.items())
        if classes:  # an idle queue stays indexed where it last sent
            assert st.keys == set().union(*classes)
        assert {k for k, users in model._on_res.items() if st in users} == st.keys


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


@pytest.mark.parametrize("penalty", [0.0, 0.3])
def test_one_class_alone_is_its_filling(penalty):
    rng = random.Random(5)
    for _ in range(2000):
        caps = [rng.choice((rng.uniform(1e8, 1e11), 12.5e9, math.inf)) for _ in range(rng.randint(1, 4))]
        flows = rng.randint(1, 40)
        key = tuple(range(len(caps)))
        expected = class_rates([key], [flows], dict(enumerate(caps)), penalty)[0]
        assert one_class_rate(min(caps), flows, penalty) == expected


def test_fillings_alone_refuses_a_repeated_resource():
    cluster = load_cluster("hexgen2-het3")
    path = cluster.path(0, len(cluster) - 1)
    fillings = Fillings()
    assert fillings.alone(path, 3) == class_rates([path.names], [3], {k: r.bandwidth for k, r in zip(path.names, path.resources)})[0]
    twice = Path(path.resources + path.resources[:1], path.latency_s)
    assert fillings.alone(twice, 3) is None
