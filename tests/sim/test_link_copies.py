"""Equal messages on one path travel as one record with ``copies`` (``policies.links.Message``):
each copy is still a flow of its own in the sharing, so deliveries and counters equal sending the
copies one by one; only a policy that sends everything at once takes copies; and a simulation whose
KV hand-offs go as copies gives the same per-request timings as one whose parts go one by one."""

from __future__ import annotations

import random

import numpy as np
import pytest

import hetserve.sim.links as sim_links
from hetserve.cost.network import max_min_rates
from hetserve.policies.links import LinkModel
from hetserve.policies.transmission import TRANSMISSION_POLICIES
from hetserve.sim import SimOptions, simulate
from hetserve.sim.links import SharedLinks
from hetserve.specs.cluster import load_cluster
from hetserve.specs.model import load_model
from hetserve.specs.network import Resource
from hetserve.specs.workload import load_workload
from tests.sim.plans import het1_disaggregated


def _drive(model_cls, as_copies: bool, seed: int = 11):
    """Bursts of hand-offs, each with several equal parts on one path (fair links)."""
    cluster = load_cluster("hexgen2-het3")
    model = model_cls(TRANSMISSION_POLICIES["fair"])
    rng, n, now, out, mid = random.Random(seed), len(cluster), 0.0, {}, 0
    members: dict[int, list[int]] = {}  # record id -> the message ids it stands for
    for _ in range(120):
        now += rng.expovariate(40.0)
        while (t := model.next_event_s()) is not None and t <= now:
            out.update(model.advance(t))
        items = []
        for _ in range(rng.randint(1, 4)):
            a, b = rng.sample(range(n), 2)
            nbytes, k = rng.choice((3e6, 4e7)), rng.randint(1, 4)
            ids = list(range(mid + 1, mid + k + 1))
            mid += k
            if as_copies:
                members[ids[0]] = ids
                items.append((ids[0], "kv", cluster.path(a, b), nbytes, k))
            else:
                items += [(i, "kv", cluster.path(a, b), nbytes) for i in ids]
        out.update(model.put_many(items, now))
    while (t := model.next_event_s()) is not None:
        out.update(model.advance(t))
    if as_copies:
        out = {i: at for rec, at in out.items() for i in members[rec]}
    counters = {name: (q.busy_s, dict(q.bytes_sent), dict(q.messages), dict(q.queueing_s))
                for name, q in model.queues.items()}
    return out, counters, mid


@pytest.mark.parametrize("model_cls", [SharedLinks, LinkModel])
def test_copies_deliver_as_the_messages_one_by_one(model_cls):
    one, one_counters, n = _drive(model_cls, as_copies=False)
    many, many_counters, _ = _drive(model_cls, as_copies=True)
    assert len(one) == n and many == one  # every copy's delivery, bit for bit
    for name, (busy, sent, msgs, waited) in one_counters.items():
        assert many_counters[name][0] == busy
        assert many_counters[name][2] == msgs
        for k in sent:  # the same bytes, summed in another order
            assert many_counters[name][1][k] == pytest.approx(sent[k], rel=1e-12)
            assert many_counters[name][3][k] == pytest.approx(waited[k], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("policy", ["serial", "molink"])
def test_copies_refused_where_the_policy_orders_messages(policy):
    cluster = load_cluster("hexgen2-het3")
    model = SharedLinks(TRANSMISSION_POLICIES[policy])
    with pytest.raises(ValueError, match=f"3 copies on a {policy!r} link"):
        model.put_many([(1, "kv", cluster.path(0, 9), 1e6, 3)], 0.0)
    with pytest.raises(ValueError, match="copies"):
        model.put(2, "kv", cluster.path(0, 9), 1e6, 0.0, copies=2)


def test_weighted_flow_counts_as_that_many_flows():
    x, y = Resource("x", "nic_out", 10.0, 0.0), Resource("y", "pipe", 4.0, 0.0)
    paths = [(x,), (x, y), (x,)]
    assert max_min_rates(paths[:2], weights=[2, 1]) == max_min_rates(paths)[:2]


def test_simulation_with_copies_times_every_request_alike(monkeypatch):
    """The simulator's hand-offs put equal parts on one path as copies; sent part by part, every
    request's timings come out the same, to the bit."""
    cluster, model = load_cluster("hexgen2-het1"), load_model("llama-2-70b")
    wl = load_workload("azure-conv").head(150).scale_rate(4.0)
    plan = het1_disaggregated()

    def timings():
        res = simulate(plan, cluster, model, wl, SimOptions())
        return [np.asarray(a) for a in (res.t_first, res.t_kv_start, res.t_kv_done, res.t_join, res.t_finish)]

    merged = timings()
    sent_in_copies = []
    route = sim_links.Network._route

    def part_by_part(self, src, dst):
        p, together = route(self, src, dst)
        sent_in_copies.append(together)
        return p, False

    monkeypatch.setattr(sim_links.Network, "_route", part_by_part)
    apart = timings()
    assert any(sent_in_copies)  # the plan's hand-offs did have copies to merge
    for a, b in zip(merged, apart):
        assert np.array_equal(a, b, equal_nan=True)
