"""Link counters over the transport: each worker reports its own, the engine keeps the latest.

Link counters live in the sending processes (``LinkNetwork``, one per process). Every worker sends
its counters to the engine beside each heartbeat (a ``links`` message: ``{"pid": int, "links":
[LinkStats.to_dict(), ...]}``, cumulative since the process started), over the same authenticated
connection as everything else, so the workers of every machine are counted wherever the server
runs. The engine keeps the latest report of each worker's current process and the summed counters
of its earlier ones (``LinkReports``); ``merged`` sums them per link with its own process's
counters, read at scrape time: nothing is asked of a worker then, so a dead or hung worker cannot
hold up ``/metrics``. The engine's transport takes a report only under the name its connection's
handshake carried (``wire.check_sender``).

A report is data from the network: it is checked field by field (``stats_from_wire``) before it is
kept, and one that fails is dropped whole (logged once per worker), leaving the connection and the
worker's earlier report alone.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Collection

from hetserve.policies.links import KINDS
from hetserve.runtime.links.factory import merge_stats
from hetserve.runtime.links.network import LinkStats
from hetserve.runtime.workers.wire import MAX_NAME_BYTES, Message

REPORT = "links"  # the message kind (wire.KINDS)
# links one process reports: one per peer it sends to; far above any plan's, far below the header bound
MAX_LINKS_PER_REPORT = 4096
_FIELDS = frozenset(LinkStats("", "", 0.0, 0.0).to_dict())  # what a worker sends: every field of LinkStats
log = logging.getLogger("hetserve.runtime.links")


def process_link_stats(link_scheduler: Any) -> list[LinkStats]:
    """This process's link counters, where the engine's ``link_scheduler`` hook keeps any
    (``LinkSchedulerFactory.process_stats``); [] for another hook or none."""
    own = getattr(link_scheduler, "process_stats", None)
    return own() if own is not None else []


def link_report(link_scheduler: Any, pid: int) -> Message | None:
    """The ``links`` message a worker process sends the engine; None while it has no counters."""
    stats = process_link_stats(link_scheduler)
    return Message(REPORT, {"pid": pid, "links": [s.to_dict() for s in stats]}) if stats else None


def stats_from_wire(data: Any) -> list[LinkStats]:
    """The ``links`` list of a report as ``LinkStats``; ValueError naming the first field that is
    not what a worker sends."""
    if not isinstance(data, list):
        raise ValueError(f"links must be a list, got {type(data).__name__}")
    if len(data) > MAX_LINKS_PER_REPORT:
        raise ValueError(f"{len(data)} links in one report (at most {MAX_LINKS_PER_REPORT})")
    return [_one(entry, i) for i, entry in enumerate(data)]


def _one(d: Any, i: int) -> LinkStats:
    if not isinstance(d, dict) or set(d) != _FIELDS:
        raise ValueError(f"links[{i}] must be a map of exactly {', '.join(sorted(_FIELDS))}")
    where = f"links[{i}]"
    s = LinkStats(_name(d["src"], f"{where}.src"), _name(d["dst"], f"{where}.dst"),
                  _amount(d["latency_s"], f"{where}.latency_s"),
                  _amount(d["bandwidth"], f"{where}.bandwidth", infinite=True))
    for field, check in (("bytes_sent", _amount), ("messages", _count), ("queueing_s", _amount)):
        per_kind = d[field]
        if not isinstance(per_kind, dict) or not set(per_kind) <= set(KINDS):
            raise ValueError(f"{where}.{field} must be a map from {', '.join(KINDS)}")
        getattr(s, field).update({k: check(v, f"{where}.{field}.{k}") for k, v in per_kind.items()})
    s.busy_s = _amount(d["busy_s"], f"{where}.busy_s")
    s.pending_messages = _count(d["pending_messages"], f"{where}.pending_messages")
    s.pending_bytes = _amount(d["pending_bytes"], f"{where}.pending_bytes")
    return s


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"{where} must be an endpoint name of 1 to {MAX_NAME_BYTES} bytes")
    return value


def _amount(value: Any, where: str, infinite: bool = False) -> float:
    ok = type(value) in (int, float) and value >= 0 and (math.isfinite(value) or (infinite and value == math.inf))
    if not ok:
        raise ValueError(f"{where} must be a finite number >= 0{' or inf' if infinite else ''}, got {value!r:.40}")
    return float(value)


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} must be an integer >= 0, got {value!r:.40}")
    return value


class LinkReports:
    """The link counters of each worker, kept by the engine.

    ``handle`` is the engine transport's ``on_message`` hook (run on its receiving threads): it
    takes ``links`` messages from the workers ``known()`` names and passes every other message on.
    Per worker it keeps two entries, no more: the latest report of its current process (by pid),
    and one retired total. A report under a new pid (the worker restarted on the same device, a
    re-plan, its counters from zero in a new process) folds the previous process's last counters,
    backlog removed, into the retired total, so every series only grows, however many pids a
    worker reports under.
    """

    def __init__(self, known: Callable[[], Collection[str]]):
        self._known = known
        self._lock = threading.Lock()
        self._current: dict[str, tuple[int, list[LinkStats]]] = {}  # worker -> (pid, its latest report)
        self._retired: dict[str, list[LinkStats]] = {}  # worker -> its earlier processes' counters, summed
        self._warned: set[str] = set()

    def handle(self, msg: Message) -> bool:
        if msg.kind != REPORT:
            return False
        worker = msg.src
        if worker not in self._known():
            return True  # not (or no longer) a worker of this engine: a report of a retired process
        try:
            pid = _count(msg.meta.get("pid"), "pid")
            stats = stats_from_wire(msg.meta.get("links"))
        except ValueError as exc:
            if worker not in self._warned:
                self._warned.add(worker)
                log.warning("dropped a link report of worker %s: %s (later ones are dropped unlogged)", worker, exc)
            return True
        with self._lock:
            previous = self._current.get(worker)
            if previous is not None and previous[0] != pid:
                ended = [_without_backlog(s) for s in previous[1]]
                self._retired[worker] = merge_stats([self._retired.get(worker, []), ended])
            self._current[worker] = (pid, stats)
        return True

    def merged(self, own: list[LinkStats], live: Collection[str]) -> list[LinkStats]:
        """Every worker's counters and ``own`` (this process's), summed per link. Pending bytes and
        messages are gauges of what a live process holds now: only the current process of each
        worker in ``live`` adds its own; a dead process's counters stay, its backlog does not."""
        with self._lock:
            current = list(self._current.items())
            groups = [own, *self._retired.values()]
        for worker, (_, stats) in current:
            groups.append(stats if worker in live else [_without_backlog(s) for s in stats])
        return merge_stats(groups)

    def entries(self, worker: str) -> int:
        """How many reports' worth of counters are kept for ``worker`` (at most two)."""
        with self._lock:
            return (worker in self._current) + (worker in self._retired)


def _without_backlog(s: LinkStats) -> LinkStats:
    out = LinkStats.from_dict(s.to_dict())
    out.pending_messages, out.pending_bytes = 0, 0.0
    return out
