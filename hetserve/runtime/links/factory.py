"""The engine's ``link_scheduler`` hook for ``--shape-links``: one ``LinkNetwork`` per worker
process (``hetserve.runtime.links.network``); each process's counters reach the engine as reports
over the transport (``hetserve.runtime.links.reports``)."""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

from hetserve.policies.links import KINDS
from hetserve.runtime.links.network import (LinkNetwork, LinkStats, LinkTable, TransportLinkScheduler, transmission_policy_factory)


class LinkSchedulerFactory:
    """The engine's ``link_scheduler`` hook: a picklable ``(src endpoint, dst endpoint) -> LinkScheduler``.

    ``Engine.from_plan(..., link_scheduler=LinkSchedulerFactory(cluster, "molink"))`` ships a copy
    to every worker process; each process builds its own ``LinkNetwork`` on first use (endpoint
    names are device names; other endpoints, such as the engine's coordinator, pass unshaped).

    Link counters live in the sending processes: ``process_stats()`` reads this process's. A worker
    reports its own to the engine with each heartbeat, and ``Engine.link_stats()`` merges them
    (``hetserve.runtime.links.reports``).
    """

    def __init__(self, cluster, policy: str = "serial", shape: bool = True, time_scale: float = 1.0,
                 overhead_s: float = 0.0, competing_penalty: float = 0.0, **policy_options):
        transmission_policy_factory(policy, **policy_options)  # unknown names fail here, in the parent
        self.overhead_s, self.competing_penalty = float(overhead_s), float(competing_penalty)  # link model knobs
        self.table = cluster if isinstance(cluster, LinkTable) else LinkTable.from_cluster(cluster)
        self.policy, self.policy_options = policy, dict(policy_options)
        self.shape, self.time_scale = shape, float(time_scale)
        self._net: LinkNetwork | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_net"], state["_pid"], state["_lock"] = None, None, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def network(self) -> LinkNetwork:
        """This process's links (created on first use)."""
        import os

        with self._lock:
            if self._net is None or self._pid != os.getpid():
                self._net = LinkNetwork(self.table, transmission_policy_factory(self.policy, **self.policy_options),
                                        shape=self.shape, time_scale=self.time_scale,
                                        overhead_s=self.overhead_s, competing_penalty=self.competing_penalty)
                self._pid = os.getpid()
            return self._net

    def __call__(self, src: str, dst: str) -> TransportLinkScheduler:
        return TransportLinkScheduler(self.network().link(src, dst))

    def process_stats(self) -> list[LinkStats]:
        """This process's link counters: [] where it has sent nothing through this factory (a copy
        made elsewhere does not count another process's links)."""
        import os

        with self._lock:
            net = self._net if self._pid == os.getpid() else None
        return net.stats() if net is not None else []

    def close(self) -> None:
        if self._net is not None:
            self._net.close()


def merge_stats(groups: Iterable[Sequence[LinkStats]]) -> list[LinkStats]:
    """Sum the stats of the same (src, dst) link reported by several processes."""
    out: dict[tuple[str, str], LinkStats] = {}
    for group in groups:
        for s in group:
            cur = out.get((s.src, s.dst))
            if cur is None:
                out[(s.src, s.dst)] = LinkStats.from_dict(s.to_dict())
                continue
            for k in KINDS:
                cur.bytes_sent[k] += s.bytes_sent.get(k, 0.0)
                cur.messages[k] += s.messages.get(k, 0)
                cur.queueing_s[k] += s.queueing_s.get(k, 0.0)
            cur.busy_s += s.busy_s
            cur.pending_messages += s.pending_messages
            cur.pending_bytes += s.pending_bytes
    return list(out.values())
