"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Request-level series are observed as requests finish; replica and link series are read from the
backend at scrape time (a custom collector), so they are never stale and cost nothing between
scrapes.

    hetserve_time_to_first_token_seconds       histogram
    hetserve_time_per_output_token_seconds     histogram (per request: (e2e - ttft) / (tokens - 1))
    hetserve_e2e_request_latency_seconds       histogram
    hetserve_requests_total{endpoint,outcome}  counter  (outcome: stop, length, aborted, error, rejected,
                                                        unavailable: no live replica could serve it,
                                                        unauthorized: no key or a wrong one; endpoint:
                                                        completions, chat, admin, other)
    hetserve_prompt_tokens_total / hetserve_generation_tokens_total (every generated token, aborted streams' too)
    hetserve_requests_in_flight                gauge    (admitted by HTTP, not finished)
    hetserve_replica_up{replica,role}                gauge    (1 serving, 0 lost a worker)
    hetserve_replica_queued_requests{replica,role}   gauge
    hetserve_replica_running_requests{replica,role}  gauge
    hetserve_replica_kv_used_tokens{replica,role}    gauge
    hetserve_replica_kv_capacity_tokens{replica,role} gauge
    hetserve_replica_kv_usage_ratio{replica,role}    gauge
    hetserve_link_bytes_total{src,dst,kind}          counter
    hetserve_link_messages_total{src,dst,kind}       counter
    hetserve_link_queueing_seconds_total{src,dst,kind} counter  (Σ time from enqueue to first byte)
    hetserve_link_busy_seconds_total{src,dst}        counter
    hetserve_link_pending_bytes{src,dst}             gauge    (link series: every sending process's counters,
                                                        each worker's as of its latest report beside its
                                                        heartbeat, wherever it runs: Engine.link_stats)
    hetserve_worker_deaths_total                     counter  (workers that died or were declared frozen)
    hetserve_replans_total{trigger,outcome}          counter  (trigger: failure, retry, request; outcome: done, failed)
    hetserve_device_channel_total{worker,count}      counter  (a worker's device-channel counts as of its
                                                        latest heartbeat: transfers and bytes by path,
                                                        resent, refused, failed; runtime/workers/device_channel.py)
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, backend_snapshot: Callable[[], tuple[list, list]],
                 refused: Callable[[], dict[str, int]] = dict,
                 channels: Callable[[], dict[str, dict[str, int]]] = dict,
                 loads: Callable[[], dict[str, float]] = dict,
                 faults: Callable[[], tuple[int, dict[tuple[str, str], int]]] = lambda: (0, {})):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("hetserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hetserve_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("hetserve_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("hetserve_requests", "Finished requests", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("hetserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("hetserve_generation_tokens", "Generated tokens", registry=r)
        self.in_flight = Gauge("hetserve_requests_in_flight", "Requests admitted and not finished", registry=r)
        r.register(_ScrapeCollector(backend_snapshot, _backend_families))
        r.register(_ScrapeCollector(refused, _refused_families))
        r.register(_ScrapeCollector(channels, _channel_families))
        r.register(_ScrapeCollector(loads, _load_families))
        r.register(_ScrapeCollector(faults, _fault_families))

    def observe(self, ttft_s: float | None, e2e_s: float, output_tokens: int) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (output_tokens - 1))
        self.e2e.observe(e2e_s)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ScrapeCollector:
    """Families built at scrape time from what ``read()`` returns (``families(data)`` yields them)."""

    def __init__(self, read: Callable[[], Any], families: Callable[[Any], Iterator]):
        self.read, self.families = read, families

    def describe(self):
        return []  # series depend on the deployment; nothing to pre-declare

    def collect(self):
        yield from self.families(self.read())


def _refused_families(counts: dict[str, int]):
    """Connections the runtime's endpoints (engine and workers) closed before or while reading them:
    a failed handshake, a malformed message, too many handshakes at once (docs/security.md)."""
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily("hetserve_refused_connections", "Runtime connections closed unread, by reason",
                              labels=["reason"])
    for reason in ("handshake", "malformed", "busy"):
        fam.add_metric([reason], counts.get(reason, 0))
    yield fam


def _load_families(loads: dict[str, float]):
    """Each worker's start-up: seconds to make its stage (read or draw its weights), as it measured."""
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily("hetserve_worker_load_seconds", "Seconds each worker took to make its stage "
                            "(read or draw its weights), as it measured at start-up", labels=["worker"])
    for worker, seconds in sorted(loads.items()):
        fam.add_metric([worker], seconds)
    yield fam


def _channel_families(channels: dict[str, dict[str, int]]):
    """Each worker's device-channel counts (``DeviceChannel.stats``)."""
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily("hetserve_device_channel", "Device-channel counts per worker, as of its latest "
                              "heartbeat", labels=["worker", "count"])
    for worker, counts in sorted(channels.items()):
        for name, n in sorted(counts.items()):
            fam.add_metric([worker, name], n)
    yield fam


def _fault_families(faults: tuple[int, dict[tuple[str, str], int]]):
    """Worker deaths and re-plans (``serve.replan.Replanner.counts``): what an operator alerts on."""
    from prometheus_client.core import CounterMetricFamily

    deaths, replans = faults
    yield CounterMetricFamily("hetserve_worker_deaths", "Workers that died or were declared frozen", value=deaths)
    fam = CounterMetricFamily("hetserve_replans", "Re-plans by trigger (failure, retry, request) and outcome",
                              labels=["trigger", "outcome"])
    for (trigger, outcome), n in sorted(replans.items()):
        fam.add_metric([trigger, outcome], n)
    yield fam


def _backend_families(snapshot: tuple[list, list]):
    """Replica and link series from the backend's ``(replica states, link stats)``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    replicas, links = snapshot
    rl = ["replica", "role"]
    fams = {
        "up": GaugeMetricFamily("hetserve_replica_up", "1 while the replica serves, 0 once it lost a worker",
                                labels=rl),
        "queued": GaugeMetricFamily("hetserve_replica_queued_requests", "Requests waiting on a replica", labels=rl),
        "running": GaugeMetricFamily("hetserve_replica_running_requests", "Requests in a replica's running batch",
                                     labels=rl),
        "kv_used": GaugeMetricFamily("hetserve_replica_kv_used_tokens", "KV-cache tokens in use", labels=rl),
        "kv_cap": GaugeMetricFamily("hetserve_replica_kv_capacity_tokens", "KV-cache pool size in tokens",
                                    labels=rl),
        "kv_ratio": GaugeMetricFamily("hetserve_replica_kv_usage_ratio", "KV-cache use (0..1)", labels=rl),
        "preempted": CounterMetricFamily("hetserve_replica_preemptions", "Requests pre-empted to free KV "
                                         "blocks (--kv-admission paged), recomputed later", labels=rl),
    }
    for s in replicas:
        lab = [s.id, s.role]
        fams["up"].add_metric(lab, 1.0 if s.alive else 0.0)
        fams["queued"].add_metric(lab, s.queued_requests)
        fams["running"].add_metric(lab, s.running_requests)
        fams["kv_used"].add_metric(lab, s.kv_used_tokens)
        fams["kv_cap"].add_metric(lab, s.kv_capacity_tokens)
        fams["kv_ratio"].add_metric(lab, s.kv_used_tokens / s.kv_capacity_tokens if s.kv_capacity_tokens else 0.0)
        fams["preempted"].add_metric(lab, s.preemptions)
    yield from fams.values()

    ll, lk = ["src", "dst"], ["src", "dst", "kind"]
    nbytes = CounterMetricFamily("hetserve_link_bytes", "Bytes sent on a link", labels=lk)
    msgs = CounterMetricFamily("hetserve_link_messages", "Messages sent on a link", labels=lk)
    queue = CounterMetricFamily("hetserve_link_queueing_seconds", "Σ time from enqueue to first byte", labels=lk)
    busy = CounterMetricFamily("hetserve_link_busy_seconds", "Time the link was sending", labels=ll)
    pending = GaugeMetricFamily("hetserve_link_pending_bytes", "Bytes waiting on a link", labels=ll)
    for s in links:
        for kind, b in s.bytes_sent.items():
            nbytes.add_metric([s.src, s.dst, kind], b)
            msgs.add_metric([s.src, s.dst, kind], s.messages.get(kind, 0))
            queue.add_metric([s.src, s.dst, kind], s.queueing_s.get(kind, 0.0))
        busy.add_metric([s.src, s.dst], s.busy_s)
        pending.add_metric([s.src, s.dst], s.pending_bytes)
    yield from (nbytes, msgs, queue, busy, pending)
