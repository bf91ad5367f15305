"""Aladdin placement: best fit under constraints (b)-(e), γ, re-prediction and re-balancing.

Each scenario is built so round robin (first candidate), JSQ (least loaded) or a constraint-blind
best fit would choose differently from Aladdin. Aladdin inside the simulator, the registries and the
CLI: ``test_aladdin_wiring.py``.
"""

import dataclasses

import pytest

from hetserve.cost.fitted import DecodeModel, KVModel, PerformanceModel, PrefillModel
from hetserve.policies.aladdin import AladdinPlacement
from hetserve.policies.aladdin_route import AladdinRoute
from hetserve.policies.base import ReplicaState, RequestInfo, RunningRequest
from hetserve.policies.predictor import BucketMeanPredictor
from hetserve.specs.workload import SLO

# prefill: 1 ms/token; decode: t = 1e-5·Σctx + 1e-3·b + 0.01 s  => at ATGT 50 ms, Σctx ≤ 4000 - 100·b
MODEL = PerformanceModel(PrefillModel(1e-3, 0.0), DecodeModel(1e-5, 1e-3, 0.01), KVModel(1.0), 10_000)
SLO_ = SLO(ttft_s=1.0, tpot_s=0.05)


def req(i, l_in=100, pred=100):
    return RequestInfo(i, 0.0, l_in, pred)


def worker(rid, reqs=(), role="decode", queued_prefill=0, cap=10_000, capacity_norm=1.0):
    reqs = tuple(reqs)
    ctx = sum(r.input_tokens + r.generated_tokens for r in reqs)
    return ReplicaState(rid, role, 0, len(reqs), queued_prefill, 0.0, ctx, ctx, cap, reqs, capacity_norm)


def running(i, l_in, gen, pred, dec_time=0.0):
    return RunningRequest(i, l_in, gen, pred, dec_time)


def test_best_fit_picks_the_fullest_feasible_worker():
    light = worker("light", [running(1, 100, 10, 100)])
    full = worker("full", [running(k, 200, 10, 100) for k in range(2, 7)])
    empty = worker("empty")
    pol = AladdinPlacement(MODEL, SLO_)
    # round robin would take "light" (first), JSQ "empty"; best fit takes the fullest
    assert pol.choose(req(10), [light, full, empty], 0.0) == "full"


def test_ranking_is_by_capacity_norm_not_request_count():
    many_small = worker("many", [running(k, 10, 1, 10) for k in range(4)])
    few_big = worker("big", [running(10 + k, 1000, 1, 100) for k in range(2)])
    pol = AladdinPlacement(MODEL, SLO_)
    assert pol.capacity_norm(few_big) > pol.capacity_norm(many_small)
    assert pol.choose(req(20), [many_small, few_big], 0.0) == "big"


def test_refuses_worker_whose_atgt_would_break():
    # 10 requests of 330 context tokens: Σ = 3300 + 100 new; limit at b = 11 is 4000 - 1100 = 2900
    near = worker("near", [running(k, 300, 30, 60) for k in range(10)])
    other = worker("other", [running(50, 100, 1, 100)])
    pol = AladdinPlacement(MODEL, SLO_)
    assert not pol.check(req(99), near).atgt
    assert pol.choose(req(99), [near, other], 0.0) == "other"


def test_gamma_is_the_strictness_knob():
    # 5 requests of 400 input, predicted 400 output: γ=0 counts 2000 tokens, γ=1 counts 4000
    reqs = [running(k, 400, 0, 400) for k in range(5)]
    w = worker("w", reqs)
    new = req(9, l_in=100, pred=100)
    assert AladdinPlacement(MODEL, SLO_, gamma=0.0).check(new, w).atgt
    assert not AladdinPlacement(MODEL, SLO_, gamma=1.0).check(new, w).atgt


def test_refuses_worker_whose_ttft_would_break():
    busy = worker("busy", [running(1, 100, 5, 50)] * 1, role="colocated", queued_prefill=950)
    idle = worker("idle", role="colocated")
    pol = AladdinPlacement(MODEL, SLO_)
    # 950 queued + 100 = 1.05 s of prefill > 1 s TTFT
    assert not pol.check(req(7), busy).ttft
    assert pol.choose(req(7), [busy, idle], 0.0) == "idle"


def test_refuses_worker_whose_future_kv_would_overflow():
    # Now: 4 x 1000 = 4000 tokens held, far below 10k. But all four grow by 1400 more tokens:
    # just before their end they hold 4 x 2400 = 9600; a new request of 100 input and 1500
    # output then holds 1500 more: 11,100 > 10k.
    long_tail = worker("tail", [running(k, 900, 100, 1500) for k in range(4)])
    roomy = worker("roomy", [running(9, 100, 10, 20)])
    pol = AladdinPlacement(MODEL, SLO(ttft_s=None, tpot_s=None))
    assert long_tail.kv_used_tokens < 0.5 * long_tail.kv_capacity_tokens
    check = pol.check(req(5, 100, 1500), long_tail)
    assert not check.kv and check.atgt
    assert pol.check(req(5, 100, 300), long_tail).kv  # a short one ends before the peak: fits
    assert pol.choose(req(5, 100, 1500), [long_tail, roomy], 0.0) == "roomy"


def test_kv_peak_counts_requests_that_end_early_only_until_they_end():
    pol = AladdinPlacement(MODEL, SLO(None, None))
    w = worker("w", [running(1, 5000, 0, 10), running(2, 100, 0, 4000)])
    v = pol._view(w)
    # peak: at t=0 both (5100) vs at t=4000 only the long one (4100) vs t=10: 5010 + 110
    assert pol.kv_peak(MODEL, v) == pytest.approx(max(5100, 5010 + 110, 4100))


def test_prefill_preempting_decode_is_bounded_by_saved_time():
    # a colocated worker whose running request has used up its ATGT budget: no slack for a prefill
    tight = worker("tight", [running(1, 100, 100, 200, dec_time=100 * 0.05)], role="colocated")
    relaxed = worker("relaxed", [running(2, 100, 100, 200, dec_time=100 * 0.02)], role="colocated")
    pol = AladdinPlacement(MODEL, SLO_, project_slack=False)
    assert not pol.check(req(3), tight).preempt
    assert pol.check(req(3), relaxed).preempt  # saved 3 s > 0.1 s of prefill
    assert pol.choose(req(3), [tight, relaxed], 0.0) == "relaxed"


def test_overflow_goes_to_least_loaded_and_is_counted():
    a = worker("a", [running(k, 900, 0, 1000) for k in range(8)])
    b = worker("b", [running(20 + k, 900, 0, 1000) for k in range(4)])
    pol = AladdinPlacement(MODEL, SLO_)
    assert pol.choose(req(1, 3000, 3000), [a, b], 0.0) == "b"
    assert pol.stats["overflow"] == 1


def test_overflow_on_prefill_stall_goes_where_it_overdraws_least_saved_time():
    # Every worker fails only (d): a 900-token prompt (0.9 s of prefill) exceeds what any of their
    # requests has saved. "fresh" is the least loaded but its request has just joined (saved 0 s);
    # "saved" holds four requests that have each saved 0.25 s. The stall overdraws 0.65 s there
    # against 0.9 s on "fresh", so it goes to "saved" — least loaded would stack it on "fresh"
    # (in bursts: one prompt after another on the worker with the least context).
    fresh = worker("fresh", [running(1, 100, 1, 50)], role="colocated")
    saved = worker("saved", [running(10 + k, 100, 10, 50, dec_time=10 * 0.02) for k in range(4)], role="colocated")
    # (b) fails on "full" (Σctx beyond Eq. 4's limit) although its requests saved the most, and (e) on
    # "small_kv" (a 300-token KV pool) although the stall would overdraw only 0.55 s there: the
    # overdraft ranks only workers where (d) alone fails
    full = worker("full", [running(20 + k, 250, 40, 50, dec_time=0.0) for k in range(10)], role="colocated")
    small_kv = worker("small_kv", [running(40 + k, 100, 10, 50, dec_time=10 * 0.01) for k in range(2)],
                      role="colocated", cap=300)
    pol = AladdinPlacement(MODEL, SLO_)
    new = req(30, 900, 20)
    checks = [pol.check(new, w) for w in (fresh, saved, full, small_kv)]
    assert [c.ok for c in checks] == [False, False, False, False]
    assert checks[0].atgt and checks[0].ttft and checks[0].kv and not checks[0].preempt
    assert checks[1].atgt and checks[1].ttft and checks[1].kv and not checks[1].preempt
    assert not checks[2].atgt
    assert pol.screen(new, small_kv, 20).ok and not checks[3].kv and not checks[3].preempt
    v = {w.id: pol._view(w) for w in (fresh, saved, small_kv)}
    assert pol.overdraft(new, small_kv, 20, v["small_kv"]) < pol.overdraft(new, saved, 20, v["saved"]) < \
        pol.overdraft(new, fresh, 20, v["fresh"])
    assert pol.rough_norm(fresh) < pol.rough_norm(saved)  # least loaded would pick "fresh"
    assert pol.choose(new, [fresh, full, small_kv, saved], 0.0) == "saved"
    assert pol.stats["overflow"] == 1
    old = AladdinPlacement(MODEL, SLO_, overflow="least_loaded")
    assert old.choose(new, [fresh, full, small_kv, saved], 0.0) == "fresh"


def test_outlived_requests_are_repredicted_into_the_constraints():
    pred = BucketMeanPredictor().fit([900] * 50, [300] * 25 + [3000] * 25)  # bucket mean 1650
    # A request predicted 1650 tokens has generated 1700: re-predicted as E[out | out > 1700] = 3000,
    # so it will hold 900 + 3000 tokens, not 900 + 1700. Three of them plus a new one overflow KV.
    w = worker("w", [running(k, 900, 1700, 1650) for k in range(3)])
    other = worker("other")
    pol = AladdinPlacement(MODEL, SLO(None, None), predictor=pred, rebalance=False)
    assert pol._view(w).pred.tolist() == [3000.0] * 3
    assert not pol.check(req(5, 100, 100), w).kv
    assert pol.choose(req(5, 100, 100), [w, other], 0.0) == "other"


def test_rebalancing_moves_new_requests_off_underestimated_workers():
    pred = BucketMeanPredictor(prior=50).fit([100] * 10, [50] * 10)
    under = worker("under", [running(1, 100, 60, 50), running(2, 100, 10, 50), running(3, 100, 10, 50)])
    over = worker("over", [running(4, 100, 10, 50)])
    # "over" also had a request finish far earlier than predicted
    for moved in (False, True):
        pol = AladdinPlacement(MODEL, SLO(None, 0.05), predictor=pred, rebalance=moved)
        pol._placed[77] = ("over", 400.0)
        pol.on_finish(77, 100, 5)
        choice = pol.choose(req(10), [under, over], 0.0)
        assert choice == ("over" if moved else "under")
    assert pol.stats["moved"] == 1


def test_predictor_learns_through_on_finish():
    pred = BucketMeanPredictor(prior=10)
    pol = AladdinPlacement(MODEL, SLO_, predictor=pred)
    pol.choose(req(1, 100), [worker("a")], 0.0)
    pol.on_finish(1, 100, 300)
    assert pred.predict(1, 100) == 300


def test_route_policy_places_on_decode_replicas():
    full = worker("d-full", [running(k, 200, 10, 100) for k in range(3)])
    empty = worker("d-empty")
    route = AladdinRoute(AladdinPlacement(MODEL, SLO_))
    assert route.choose(req(1), "p0", [(empty, 0.5), (full, 0.5)], 0.0) == "d-full"
    assert route.choose(req(2), "p0", [(empty, 1.0), (full, 0.0)], 0.0) == "d-empty"


def test_per_replica_models_and_bad_knobs():
    slow = PerformanceModel(PrefillModel(1e-2, 0.0), MODEL.decode, MODEL.kv, 10_000)
    pol = AladdinPlacement({"fast": MODEL, "slow": slow}, SLO_)
    ws = [worker("slow", role="colocated", queued_prefill=50), worker("fast", role="colocated", queued_prefill=50)]
    assert pol.choose(req(1, 200), ws, 0.0) == "fast"  # 250 tokens: 2.5 s on slow > 1 s TTFT
    with pytest.raises(ValueError):
        AladdinPlacement(MODEL, SLO_, gamma=1.5)
    with pytest.raises(KeyError, match="no performance model"):
        pol.choose(req(2), [worker("nope")], 0.0)


# ----------------------------------------------------------------------------- no SLO, TTFT accounting, screening, groups


def test_prefill_workers_without_ttft_target_are_balanced_not_packed():
    """No TTFT target: prefill workers have no bin size; best fit would pile every prompt on the
    fullest one (regression: p99 TTFT of minutes). They go to the earliest predicted finish."""
    slow = PerformanceModel(PrefillModel(2e-3, 0.0), MODEL.decode, MODEL.kv, 10_000)
    pol = AladdinPlacement({"p0": MODEL, "p1": MODEL, "p2": slow}, SLO(None, 0.05))
    p = [ReplicaState("p0", "prefill", 3, 1, 900, 1200.0, 0, 0, 0),
         ReplicaState("p1", "prefill", 1, 0, 300, 300.0, 0, 0, 0),
         ReplicaState("p2", "prefill", 0, 0, 0, 200.0, 0, 0, 0)]
    # fullest-first would take p0; round robin p0; JSQ p2 (fewest requests); the earliest finish
    # of a 100-token prompt is p1 (0.4 s) — p2's slower law gives 0.6 s
    assert pol.choose(req(1), p, 0.0) == "p1"
    assert pol.stats["unbounded"] == 1 and pol.stats["overflow"] == 0
    # with a TTFT target the same workers are bins again: the fullest one that still meets it
    packed = AladdinPlacement({"p0": MODEL, "p1": MODEL, "p2": slow}, SLO(2.0, 0.05))
    assert packed.choose(req(2), p, 0.0) == "p0" and packed.stats["unbounded"] == 0


def test_ttft_counts_the_running_prefill_and_the_batch_it_joins():
    """(c): 300 queued tokens + 100 new = 0.4 s of prefill fits a 1 s target alone, but not after
    0.7 s still to run of the prefill now running, nor when the oldest queued prompt has already
    waited 0.7 s (the new prompt lengthens its batch)."""
    pol = AladdinPlacement(MODEL, SLO_)
    idle = worker("idle", role="colocated", queued_prefill=300)
    busy = dataclasses.replace(idle, id="busy", prefill_wait_s=0.7)
    old = dataclasses.replace(idle, id="old", queued_age_s=0.7)
    assert pol.check(req(1), idle).ttft
    assert not pol.check(req(1), busy).ttft and not pol.screen(req(1), busy, 100).ttft
    assert not pol.check(req(1), old).ttft
    # batches of at most token_budget tokens each pay the prefill constant once
    two = AladdinPlacement(PerformanceModel(PrefillModel(1e-3, 0.2), MODEL.decode, MODEL.kv, 10_000), SLO_,
                           token_budget=256)
    assert two.ttft_estimate(req(1), idle) == pytest.approx(2 * (0.2 + 0.2))


def test_screen_rules_out_an_overloaded_worker_without_its_request_views():
    """A worker whose totals already break (b) is never asked for its per-request views, so an
    overloaded queue costs O(1) per decision (linear simulation under overload)."""

    class Exploding(tuple):
        def __iter__(self):
            raise AssertionError("per-request views were built for a worker the totals rule out")

        def __len__(self):
            raise AssertionError("per-request views were built for a worker the totals rule out")

    # 300 queued requests of 100 prompt tokens: the batch alone exceeds Eq. 4's limit at the ATGT
    flooded = ReplicaState("flooded", "colocated", 300, 10, 30_000, 60_000.0, 3_000, 3_000, 10_000, Exploding(), 1.0)
    spare = worker("spare", [running(1, 100, 10, 100)], role="colocated")
    pol = AladdinPlacement(MODEL, SLO_)
    assert not pol.screen(req(5), flooded, 100).ok
    assert pol.choose(req(5), [flooded, spare], 0.0) == "spare"
    # and when no worker fits, the least loaded is found from the totals too
    flooded2 = dataclasses.replace(flooded, id="flooded2", queued_requests=600, queued_prefill_tokens=60_000)
    assert pol.choose(req(6), [flooded2, flooded], 0.0) == "flooded"
    assert pol.stats["overflow"] == 1


def test_grouped_scheduling_deals_round_robin_and_keeps_groups_apart():
    from hetserve.policies.grouped import GroupedPlacement, split_groups

    ids = ["a", "b", "c", "d", "e"]
    assert split_groups(ids, 2) == [["a", "b", "c"], ["d", "e"]]
    seen = []

    class Spy:
        needs_requests = False

        def __init__(self, members):
            self.members, self.finished = members, []

        def choose(self, request, cands, now):
            seen.append((request.id, tuple(c.id for c in cands)))
            return cands[-1].id

        def on_finish(self, rid, i, o):
            self.finished.append(rid)

    g = GroupedPlacement(split_groups(ids, 2), Spy)
    cands = [worker(i) for i in ids]
    picks = [g.choose(req(k), cands, 0.0) for k in range(4)]
    assert picks == ["c", "e", "c", "e"]
    assert seen[0][1] == ("a", "b", "c") and seen[1][1] == ("d", "e")
    g.on_finish(1, 100, 10)
    assert g.policies[1].finished == [1] and g.policies[0].finished == []
