"""A queue alone in its component is re-shared without searching its component
(``SharedLinks._reindex``): deliveries and counters equal, to the bit, those of re-sharing every
change through the search, and a queue marked alone shares no resource with another send."""

from __future__ import annotations

import random

import pytest

from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim import sharing
from hetserve.sim.links import SharedLinks
from hetserve.specs.cluster import load_cluster

from tests.interpreted import only_interpreted

pytestmark = only_interpreted(sharing, "subclasses SharedLinks to search every component")


class _Searched(SharedLinks):
    """Every queue re-shared through the component search: none is ever marked alone."""

    def _reshare(self, comp):
        super()._reshare(comp)
        for st in comp:
            st.alone = False


def _check_alone(model: SharedLinks) -> None:
    model.next_event_s()  # re-shared
    busy = [q.sharing for q in model.queues.values() if q.sends]
    for st in busy:
        if st.alone:
            for other in busy:
                assert other is st or not (other.keys & st.keys), (st.q.name, other.q.name)


def _drive(model_cls, policy: str, seed: int, check: bool = False):
    cluster = load_cluster("hexgen2-het3")
    model = model_cls(TRANSMISSION_POLICIES[policy])
    rng, n, now, out = random.Random(seed), len(cluster), 0.0, []
    for mid in range(300):
        now += rng.expovariate(300.0)
        while (t := model.next_event_s()) is not None and t <= now:
            out += model.advance(t)
            if check:
                _check_alone(model)
        a, b = rng.sample(range(n), 2)
        items = [(f"{mid}.{i}", "kv", cluster.path(a, rng.randrange(n) if i else b), rng.choice((2e4, 3e6, 4e7)))
                 for i in range(rng.choice((1, 1, 3)))]
        items = [it for it in items if it[2].resources]
        out += model.put_many(items, now)
        if check:
            _check_alone(model)
    while (t := model.next_event_s()) is not None:
        out += model.advance(t)
    counters = {name: (q.busy_s, dict(q.bytes_sent)) for name, q in model.queues.items()}
    return out, counters


@pytest.mark.parametrize("policy", ["fair", "serial", "molink"])
def test_alone_queues_reshare_as_the_search_does(policy):
    for seed in range(3):
        assert _drive(SharedLinks, policy, seed, check=True) == _drive(_Searched, policy, seed)
