"""The engine with its device channel on (gloo between CPU workers): every plan shape the engine
tests use gives the tokens of the socket path with every tensor between workers on the channel; a
worker killed while KV pieces are on the channel loses no request and delivers no token twice; a
worker frozen past the channel's timeout gets every transfer once (by the channel or by the
sender's socket resend).

The faults are timed by freezing a receiver (SIGSTOP): what is sent to it meanwhile is sent and not
yet taken, so the kill or the timeout falls mid-transfer, not by chance."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hetserve.runtime.params import SamplingParams

PROMPTS = [[(i * 13 + k * 7) % 250 + 1 for k in range(5 + 3 * i)] for i in range(16)]
MAX_NEW = 16
RECEIVER = "m0:2"  # the disaggregated plan's first decode stage: every prefill rank hands it KV pieces
SENDERS = ("m0:0", "m0:1")  # the prefill replica's TP ranks


# (devices, layers) per stage, per replica: (id, role, stages); a P/D plan routes p0's KV to d0
SHAPES = {
    # two pipeline stages of TP 1 (test_engine_behaviour): activations stage to stage
    "pipeline": [("c0", "colocated", [(["m0:0"], [0, 1]), (["m0:1"], [1, 3])])],
    # asymmetric: TP 2 on layer 0, then TP 1 (the conftest's colocated plan)
    "asymmetric": [("c0", "colocated", [(["m0:0", "m0:1"], [0, 1]), (["m0:2"], [1, 3])])],
    # TP 2 on both stages: only the stage leaders share a channel
    "tp2-pipeline": [("c0", "colocated", [(["m0:0", "m0:1"], [0, 2]), (["m0:2", "m0:3"], [2, 3])])],
    # prefill TP 2 -> decode of two TP-1 stages (the conftest's disaggregated plan): KV re-sharded 2 -> 1 + 1
    "pd-tp2-to-pp2": [("p0", "prefill", [(["m0:0", "m0:1"], [0, 3])]),
                      ("d0", "decode", [(["m0:2"], [0, 2]), (["m0:3"], [2, 3])])],
    # prefill TP 1 -> decode TP 2: each decode rank gets its KV head from the one prefill worker
    "pd-tp1-to-tp2": [("p0", "prefill", [(["m0:0"], [0, 3])]), ("d0", "decode", [(["m0:1", "m0:2"], [0, 3])])],
}
SHAPE_PROMPTS = [list(b"Hello, heterogeneous world!"), [5, 9, 2], list(range(40, 90)), list(b"A")]
CHOICES = [dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234 + i, ignore_eos=True) for i in range(3)]
_SOCKET_CHOICES: list = []


def shape_plan(name: str):
    from hetserve.planner.plan import Plan

    replicas = [{"id": rid, "role": role, "stages": [{"devices": d, "layers": l} for d, l in stages]}
                for rid, role, stages in SHAPES[name]]
    routes = [{"from": "p0", "to": "d0", "weight": 1.0}] if name.startswith("pd") else []
    return Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": replicas, "kv_routes": routes})


def _choices(eng) -> list[list[int]]:
    """Three seeded choices of one prompt, the later two sharing the first one's prefill."""
    first = eng.submit(SHAPE_PROMPTS[0], SamplingParams(**CHOICES[0]))
    rest = [eng.submit(SHAPE_PROMPTS[0], SamplingParams(**c), share_prefix_with=first) for c in CHOICES[1:]]
    return [h.result(timeout=60) for h in (first, *rest)]


def socket_choices(model_dir, cluster_file, plans) -> list[list[int]]:
    """The choices on one worker holding every layer, channel off: nothing crosses a link."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    if not _SOCKET_CHOICES:
        with Engine.from_plan(plans.single(), cluster_file, model_dir, EngineConfig(kv_capacity_tokens=1024)) as eng:
            _SOCKET_CHOICES.extend(_choices(eng))
    return _SOCKET_CHOICES


def _senders(layout) -> set[str]:
    """The workers whose tensors go to another worker: stage leaders but the last, prefill workers."""
    return ({r.stages[i][0].name for r in layout for i in range(len(r.stages) - 1)}
            | {w.name for r in layout if r.role == "prefill" for w in r.workers})


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape,chunked", [*((name, False) for name in SHAPES), ("asymmetric", True)],
                         ids=[*SHAPES, "asymmetric-chunked"])
def test_every_plan_shape_over_the_channel_gives_the_socket_paths_tokens(
        model_dirs, cluster_file, plans, hf_reference, shape, chunked):
    """Greedy streams equal transformers' generate (what the socket path gives: test_engine_equivalence),
    seeded choices sharing a prefill equal those of one worker, and every tensor between workers went
    by the channel: none by socket, none failed or resent, each sent one received."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    want = hf_reference(model_dirs["llama"], SHAPE_PROMPTS, 12)
    want_choices = socket_choices(model_dirs["llama"], cluster_file, plans)
    extra = dict(prefill_mode="chunked", chunk_tokens=16) if chunked else {}
    config = EngineConfig(kv_capacity_tokens=2048, device_channel="on", **extra)
    with Engine.from_plan(shape_plan(shape), cluster_file, model_dirs["llama"], config) as eng:
        handles = [eng.submit(p, SamplingParams(max_tokens=12)) for p in SHAPE_PROMPTS]
        assert [h.result(timeout=120) for h in handles] == want
        assert _choices(eng) == want_choices
        senders = _senders(eng.layout)

        def settled() -> bool:  # the counts come with heartbeats: until each sender's last step is in
            t = _totals(eng)
            return (all(_sent(eng, s) for s in senders)
                    and t.get("channel_in_transfers") == t.get("channel_transfers"))

        _wait("the channel's counts", settled, timeout_s=15.0)
        counts = eng.channel_stats()
    bad = ("socket_transfers", "failed", "resent", "kv_duplicates")
    assert not any(c.get(k) for c in counts.values() for k in bad), counts



_REFERENCES: dict[int, list[list[int]]] = {}


def _reference(hf_reference, model_dir, new: int) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS, once per length for the module's cases."""
    if new not in _REFERENCES:
        _REFERENCES[new] = hf_reference(model_dir, PROMPTS, new)
    return _REFERENCES[new]


def _sent(eng, worker: str) -> int:
    return eng.channel_stats().get(worker, {}).get("channel_transfers", 0)


def _pd_over_channel(model_dirs, cluster_file, plans, channel_timeout_s: float, heartbeat_timeout_s: float):
    """The P/D plan on the Llama checkpoint with device channels on."""
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig

    config = EngineConfig(kv_capacity_tokens=4096, device_channel="on", channel_timeout_s=channel_timeout_s,
                          heartbeat_timeout_s=heartbeat_timeout_s)
    return Engine.from_plan(plans.disaggregated(), cluster_file, model_dirs["llama"], config)


def _wait(what: str, ok, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < end, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.01)


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker,dead,survivor", [
    (RECEIVER, "d0", "p0"),  # the receiver of the pieces: the prefill replica decodes in place
    (SENDERS[0], "p0", "d0"),  # a sender, its pieces half taken: the decode replica prefills in place
])
def test_a_worker_killed_mid_handoff_loses_no_request_and_repeats_no_token(
        model_dirs, cluster_file, plans, hf_reference, worker, dead, survivor):
    """Hand-offs by channel, then the receiver frozen while more are sent to it (so they are sent and
    never acknowledged) and ``worker`` killed: every stream ends with transformers' greedy tokens,
    each once, re-run on the surviving replica, which then serves new requests."""
    want = _reference(hf_reference, model_dirs["llama"], MAX_NEW)
    half = len(PROMPTS) // 2
    # the freeze lasts a heartbeat or two: well within the heartbeat timeout, so only the kill is a death
    with _pd_over_channel(model_dirs, cluster_file, plans, channel_timeout_s=5.0, heartbeat_timeout_s=15.0) as eng:
        params = SamplingParams(max_tokens=MAX_NEW)
        assert eng.generate(PROMPTS[:half], params, timeout=60) == want[:half]
        # each prefill rank sends a piece to each of the two decode stages per request
        _wait("the first hand-offs counted", lambda: all(_sent(eng, s) >= 2 * half for s in SENDERS))
        before = {s: _sent(eng, s) for s in SENDERS}
        pids = eng.worker_pids()
        os.kill(pids[RECEIVER], signal.SIGSTOP)
        try:
            handles = [eng.submit(p, params) for p in PROMPTS[half:]]
            _wait("pieces sent to the frozen receiver", lambda: all(_sent(eng, s) > before[s] for s in SENDERS))
            assert eng.loop.handoffs, "no hand-off in flight"  # its pieces wait for the frozen receiver
            os.kill(pids[worker], signal.SIGKILL)
            _wait("the death noticed", lambda: eng.stats().get("deaths"))
        finally:
            if worker != RECEIVER:
                os.kill(pids[RECEIVER], signal.SIGCONT)
        # every token the stream was given (RequestHandle.tokens): one pushed twice shows here
        assert [h.result(timeout=120) for h in handles] == want[half:]
        stats = eng.stats()
        assert stats["failed"] == 0 and stats["broken"] is None
        assert [d["replica"] for d in stats["deaths"]] == [dead] and stats["reruns"] >= 1
        assert stats["replicas"][survivor]["role"] == "colocated"
        if worker != RECEIVER:  # the hand-offs in flight were fenced on the live receiver, then freed
            assert stats["kv_fenced"]["opened"] >= 1
            _wait("the fences closed", lambda: eng.stats()["kv_fenced"]["pending"] == 0)
        # the survivor goes on serving: its channels to the dead replica given up, its own still used
        before = _totals(eng).get("channel_transfers", 0)
        assert eng.generate(PROMPTS[:3], params, timeout=60) == want[:3]
        if survivor == "d0":  # two stages: their activations still go by the channel, not by socket
            _wait("the survivor's transfers counted", lambda: _totals(eng)["channel_transfers"] > before)
        alive = [w.name for w in eng.replicas[survivor].workers]
        assert not any(eng.channel_stats().get(w, {}).get("socket_transfers") for w in alive), eng.channel_stats()
        assert not _totals(eng).get("kv_duplicates")


def _totals(eng) -> dict[str, int]:
    out: dict[str, int] = {}
    for counts in eng.channel_stats().values():
        for key, n in counts.items():
            out[key] = out.get(key, 0) + n
    return out


def _delivered_once(t: dict[str, int]) -> bool:
    """Every resend arrived, each transfer was delivered once (by channel or by its resend), and no
    decode worker got a KV piece twice."""
    taken, dropped = t.get("resends_taken", 0), t.get("resends_dropped", 0)
    return (t.get("resent", 0) == taken + dropped and not t.get("kv_duplicates")
            and t.get("channel_in_transfers", 0) + taken == t.get("channel_transfers", 0))


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", ["idle", "decoding", "late"])
def test_a_receiver_frozen_past_the_channel_timeout_gets_each_transfer_once(model_dirs, cluster_file, plans,
                                                                            hf_reference, moment):
    """The last decode stage frozen (between requests, or while it decodes: activations come to it
    too) while KV pieces are sent to it, until their senders give them up and resend them by socket;
    thawed, it takes each transfer once, by the channel (whose sends were kept alive) or by the
    resend: the tokens of transformers, no death. Frozen ``late``, past the time the senders keep
    their channel sends: the first header's bytes never come, and every transfer by its resend."""
    frozen, new = "m0:3", 48
    want = _reference(hf_reference, model_dirs["llama"], new)
    half = len(PROMPTS) // 2
    with _pd_over_channel(model_dirs, cluster_file, plans, channel_timeout_s=2.0, heartbeat_timeout_s=20.0) as eng:
        params = SamplingParams(max_tokens=new)
        handles = [eng.submit(p, params) for p in PROMPTS[:half]]
        if moment != "decoding":
            assert [h.result(timeout=60) for h in handles] == want[:half]
        else:
            _wait("decode steps running", lambda: any(r == "d0" for r, *_ in list(eng.loop.steps.values())))
        pid = eng.worker_pids()[frozen]
        os.kill(pid, signal.SIGSTOP)
        try:
            handles += [eng.submit(p, params) for p in PROMPTS[half:]]
            # each prefill rank's pieces to the frozen stage time out: its channel breaks, they go by socket
            _wait("the senders' resends", lambda: all(eng.channel_stats().get(s, {}).get("resent", 0)
                                                       for s in SENDERS))
            if moment == "late":
                time.sleep(2 * eng.config.channel_timeout_s + 1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert [h.result(timeout=120) for h in handles] == want
        stats = eng.stats()
        assert stats["failed"] == 0 and stats["deaths"] == []
        # the counts come with heartbeats: wait for the last ones
        _wait("every transfer delivered once", lambda: _delivered_once(_totals(eng)), timeout_s=15.0)
        totals = _totals(eng)
        assert totals["resent"] >= len(SENDERS)
        if moment == "idle":  # nothing was half-received at the freeze: the channel's copies came first
            assert totals.get("resends_dropped") == totals["resent"], totals
        if moment == "late":
            assert totals.get("resends_taken") == totals["resent"], totals
