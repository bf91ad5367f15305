"""Link counters over the transport (``hetserve.runtime.links.reports``): every worker process reports
its own beside its heartbeats, the engine merges them with its own for ``/metrics``, whatever
machine a worker runs on; reports are checked before they are kept; a dead worker breaks nothing."""

from __future__ import annotations

import math
import os
import signal

import httpx
import pytest

from hetserve.runtime.links.network import LinkStats
from hetserve.runtime.links.reports import MAX_LINKS_PER_REPORT, LinkReports, link_report, stats_from_wire
from hetserve.runtime.workers.wire import Message

# prefill on m0:0 hands KV to a two-stage decode replica on m1:0 -> m1:1: every device link is
# sent on by a worker process, none by the server's
PLAN = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 1]},
                                              {"devices": ["m1:1"], "layers": [1, 2]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}


def _stats(src="m0:0", dst="m1:0", kv=100.0, pending=0.0) -> LinkStats:
    s = LinkStats(src, dst, 0.001, math.inf)
    s.bytes_sent["kv"], s.messages["kv"] = kv, 1
    s.pending_bytes, s.pending_messages = pending, int(pending > 0)
    return s


def _report(worker: str, pid: int, stats) -> Message:
    return Message("links", {"pid": pid, "links": [s.to_dict() for s in stats]}, src=worker)


@pytest.mark.parametrize("bad, field", [
    ("nope", "links must be a list"),
    ([{"src": "a"}], r"links\[0\] must be a map of exactly"),
    ([{**_stats().to_dict(), "extra": 1}], r"links\[0\] must be a map of exactly"),
    ([{**_stats().to_dict(), "src": ""}], r"links\[0\].src"),
    ([{**_stats().to_dict(), "dst": "x" * 300}], r"links\[0\].dst"),
    ([{**_stats().to_dict(), "latency_s": -1.0}], r"links\[0\].latency_s"),
    ([{**_stats().to_dict(), "latency_s": math.inf}], r"links\[0\].latency_s"),
    ([{**_stats().to_dict(), "busy_s": math.nan}], r"links\[0\].busy_s"),
    ([{**_stats().to_dict(), "busy_s": True}], r"links\[0\].busy_s"),
    ([{**_stats().to_dict(), "bytes_sent": {"bulk": 1.0}}], r"links\[0\].bytes_sent must be a map from"),
    ([{**_stats().to_dict(), "messages": {"kv": 1.5}}], r"links\[0\].messages.kv must be an integer"),
    ([{**_stats().to_dict(), "pending_messages": -1}], r"links\[0\].pending_messages"),
    ([_stats().to_dict()] * (MAX_LINKS_PER_REPORT + 1), "links in one report"),
])
def test_a_report_is_checked_field_by_field(bad, field):
    with pytest.raises(ValueError, match=field):
        stats_from_wire(bad)


def test_what_a_worker_sends_is_what_the_engine_reads():
    class Hook:
        def process_stats(self):
            return [_stats(pending=7.0)]

    assert link_report(lambda src, dst: None, 1) is None  # a hook that keeps no counters: nothing to send
    msg = link_report(Hook(), 42)
    assert msg.kind == "links" and msg.meta["pid"] == 42
    (back,) = stats_from_wire(msg.meta["links"])
    assert back.to_dict() == _stats(pending=7.0).to_dict() and back.bandwidth == math.inf


def test_reports_are_kept_per_worker_process_and_summed_with_this_processs_own():
    reports = LinkReports(lambda: {"m0:0", "m0:1"})
    assert reports.handle(Message("heartbeat", {}, src="m0:0")) is False  # the loop's, passed on
    assert reports.handle(_report("m0:0", 10, [_stats(kv=100.0, pending=5.0)]))
    assert reports.handle(_report("m0:0", 10, [_stats(kv=300.0, pending=5.0)]))  # cumulative: replaces
    assert reports.handle(_report("m0:1", 11, [_stats("m0:1", "m1:0", kv=50.0)]))
    assert reports.handle(_report("x:9", 12, [_stats(kv=1e9)]))  # not a worker of this engine: dropped
    assert reports.handle(_report("m0:0", 10, [_stats(kv=-1.0)]))  # malformed: dropped, the last one stays
    merged = {(s.src, s.dst): s for s in reports.merged([_stats(kv=1.0)], live={"m0:0", "m0:1"})}
    assert merged[("m0:0", "m1:0")].bytes_sent["kv"] == 301.0  # the worker's latest + the server's own
    assert merged[("m0:0", "m1:0")].pending_bytes == 5.0
    assert merged[("m0:1", "m1:0")].bytes_sent["kv"] == 50.0
    # m0:0 restarted (a new process on the device): the old process's counters stay, its backlog does not
    reports.handle(_report("m0:0", 20, [_stats(kv=7.0)]))
    merged = {(s.src, s.dst): s for s in reports.merged([], live={"m0:0"})}
    assert merged[("m0:0", "m1:0")].bytes_sent["kv"] == 307.0 and merged[("m0:0", "m1:0")].pending_bytes == 0.0


def test_a_worker_reporting_under_many_pids_keeps_two_entries_whose_counters_sum_them_all():
    reports = LinkReports(lambda: {"m0:0"})
    for pid in range(1, 201):  # each "process" sent 10 bytes of KV and holds 3 pending
        reports.handle(_report("m0:0", pid, [_stats(kv=10.0, pending=3.0)]))
        assert reports.entries("m0:0") <= 2
    (link,) = reports.merged([], live={"m0:0"})
    assert link.bytes_sent["kv"] == 2000.0 and link.messages["kv"] == 200
    assert link.pending_bytes == 3.0  # the retired processes' backlog is gone, the current one's counts
    reports.handle(_report("m0:0", 200, [_stats(kv=15.0)]))  # the same process again: replaces, folds nothing
    assert reports.merged([], live={"m0:0"})[0].bytes_sent["kv"] == 2005.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.model.make import make_model
    from hetserve.serve.launch import ServeOptions, start_server

    model = make_model(tmp_path_factory.mktemp("model") / "tiny", "llama", layers=2, hidden=64, heads=4,
                       kv_heads=2, max_positions=256)
    opts = ServeOptions(plan=Plan.from_dict(PLAN), cluster="demo-cpu", model_dir=str(model), model_name="tiny",
                        kv_capacity_tokens=256, engine_options={"heartbeat_interval_s": 0.1})
    with start_server(opts) as srv:
        yield srv


def _links(url: str) -> dict[str, float]:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in r.text.splitlines()
                                                   if line.startswith("hetserve_link_"))}


def _serve_one(url: str) -> None:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "links", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert r.json()["usage"]["completion_tokens"] == 4


KV = 'hetserve_link_bytes_total{dst="m1:0",kind="kv",src="m0:0"}'
ACTIVATIONS = 'hetserve_link_messages_total{dst="m1:1",kind="decode",src="m1:0"}'
OWN = 'hetserve_link_bytes_total{dst="m1:1",kind="prefill",src="m0:1"}'


def test_metrics_count_what_worker_processes_sent_and_this_processs_own(server, wait_until):
    _serve_one(server.url)
    # the KV hand-off (sent by the prefill worker) and decode activations (by the first decode stage)
    assert wait_until(lambda: _links(server.url).get(KV, 0) > 0 and _links(server.url).get(ACTIVATIONS, 0) >= 3, 10)
    # and the server process's own links: a send through its copy of the hook
    server.deployment.links.network().send("m0:1", "m1:1", 123, "prefill", lambda: None)
    assert _links(server.url)[OWN] == 123.0


def test_a_dead_worker_leaves_metrics_answering_with_its_last_counters(server, wait_until):
    sent = _links(server.url).get(ACTIVATIONS, 0)
    _serve_one(server.url)  # three decode steps: three activation messages m1:0 -> m1:1
    assert wait_until(lambda: _links(server.url).get(ACTIVATIONS, 0) == sent + 3, 10)
    before = _links(server.url)
    os.kill(server.deployment.engine.worker_pids()["m1:0"], signal.SIGKILL)

    def down() -> bool:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return 'hetserve_replica_up{replica="d0",role="decode"} 0.0' in text

    assert wait_until(down, 20)
    after = _links(server.url)
    assert after[ACTIVATIONS] == before[ACTIVATIONS] and after[KV] >= before[KV]
