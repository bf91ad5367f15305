"""``LinkModel.put_many`` (a KV hand-off's parts at one instant) leaves the link model exactly as
putting the parts one by one does: the same deliveries and counters, to the bit, under every
transmission policy and both models; a policy that allocates from its pending messages alone is
asked once per queue and hand-off."""

from __future__ import annotations

import random

import pytest

from hetserve.policies.links import LinkModel
from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim.links import SharedLinks
from hetserve.specs.cluster import load_cluster


def _drive(model_cls, policy: str, seed: int, many: bool, make_policy=None):
    """Bursts of messages at one instant, several from one sender (NICs and site pipes shared)."""
    cluster = load_cluster("hexgen2-het3")
    model = model_cls(make_policy or TRANSMISSION_POLICIES[policy])
    rng, n, now, out, mid = random.Random(seed), len(cluster), 0.0, [], 0
    for _ in range(150):
        now += rng.expovariate(60.0)
        while (t := model.next_event_s()) is not None and t <= now:
            out += model.advance(t)
        srcs = rng.sample(range(n), rng.randint(1, 3))
        items = []
        for _ in range(rng.randint(1, 8)):
            a = rng.choice(srcs)
            b = rng.choice([d for d in range(n) if d != a])
            mid += 1
            items.append((mid, rng.choice(("decode", "prefill", "kv", "kv")), cluster.path(a, b),
                          rng.choice((2e4, 3e6, 4e7))))
        if many:
            out += model.put_many(items, now)
        else:
            for it in items:
                out += model.put(*it, now)
    while (t := model.next_event_s()) is not None:
        out += model.advance(t)
    counters = {name: (q.busy_s, q.bytes_sent, q.messages, q.queueing_s) for name, q in model.queues.items()}
    return out, counters, mid


@pytest.mark.parametrize("model_cls", [SharedLinks, LinkModel])
@pytest.mark.parametrize("policy", ["fair", "serial", "molink"])
def test_put_many_equals_put_one_by_one(model_cls, policy):
    one, one_counters, n = _drive(model_cls, policy, seed=5, many=False)
    many, many_counters, _ = _drive(model_cls, policy, seed=5, many=True)
    assert len(one) == n
    assert many == one  # the same (id, deliver_at) in the same order, bit for bit
    assert many_counters == one_counters


def test_fair_queue_is_asked_once_per_hand_off():
    calls = []

    class Counted(TRANSMISSION_POLICIES["fair"]):
        sends_all_pending = False  # asked for its allocation, so the asking is counted

        def schedule(self, pending, *args, **kwargs):
            calls.append(len(pending))
            return super().schedule(pending, *args, **kwargs)

    cluster = load_cluster("hexgen2-het3")
    model = SharedLinks(Counted)
    items = [(k, "kv", cluster.path(0, 8 + k), 1e7) for k in range(6)]
    model.put_many(items, 0.0)
    assert calls == [6]
