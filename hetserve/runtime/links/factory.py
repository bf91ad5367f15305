"""The engine's ``link_scheduler`` hook for ``--shape-links``: one ``LinkNetwork`` per worker
process (``hetserve.runtime.links.network``), its counters written to a folder and merged on demand."""

from __future__ import annotations

import threading
import time
from typing import Iterable, Sequence

from hetserve.policies.links import KINDS
from hetserve.runtime.links.network import (LinkNetwork, LinkStats, LinkTable, TransportLinkScheduler, transmission_policy_factory)


class LinkSchedulerFactory:
    """The engine's ``link_scheduler`` hook: a picklable ``(src endpoint, dst endpoint) -> LinkScheduler``.

    ``Engine.from_plan(..., link_scheduler=LinkSchedulerFactory(cluster, "molink"))`` ships a copy
    to every worker process; each process builds its own ``LinkNetwork`` on first use (endpoint
    names are device names; other endpoints, such as the engine's coordinator, pass unshaped).

    Link counters live in the sending processes. With ``stats_dir`` set, every process writes its
    counters there (``links-<pid>.json``, every ``stats_every_s``) and ``read_stats()`` merges them
    — a stand-in until the engine can report per-worker link statistics itself.
    """

    def __init__(self, cluster, policy: str = "serial", shape: bool = True, time_scale: float = 1.0,
                 stats_dir: str | None = None, stats_every_s: float = 0.5, overhead_s: float = 0.0,
                 competing_penalty: float = 0.0, **policy_options):
        transmission_policy_factory(policy, **policy_options)  # unknown names fail here, in the parent
        self.overhead_s, self.competing_penalty = float(overhead_s), float(competing_penalty)  # link model knobs
        self.table = cluster if isinstance(cluster, LinkTable) else LinkTable.from_cluster(cluster)
        self.policy, self.policy_options = policy, dict(policy_options)
        self.shape, self.time_scale = shape, float(time_scale)
        self.stats_dir, self.stats_every_s = stats_dir, float(stats_every_s)
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
                if self.stats_dir:
                    threading.Thread(target=self._write_stats_loop, args=(self._net,), daemon=True,
                                     name="link-stats").start()
            return self._net

    def __call__(self, src: str, dst: str) -> TransportLinkScheduler:
        return TransportLinkScheduler(self.network().link(src, dst))

    def _write_stats_loop(self, net: LinkNetwork) -> None:
        import json
        import os

        path = os.path.join(self.stats_dir, f"links-{os.getpid()}.json")
        while True:
            time.sleep(self.stats_every_s)
            try:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump([s.to_dict() for s in net.stats()], f)
                os.replace(tmp, path)
            except OSError:
                return  # the directory is gone: the server shut down

    def read_stats(self) -> list[LinkStats]:
        """Every process's counters, merged per link (those written by other processes lag by up to
        ``stats_every_s``)."""
        import glob
        import json
        import os

        groups: list[list[LinkStats]] = []
        if self.stats_dir:
            for path in glob.glob(os.path.join(self.stats_dir, "links-*.json")):
                if path.endswith(f"links-{os.getpid()}.json"):
                    continue
                try:
                    with open(path) as f:
                        groups.append([LinkStats.from_dict(d) for d in json.load(f)])
                except (OSError, ValueError):
                    continue  # being replaced right now; the next scrape reads it
        if self._net is not None:
            groups.append(self._net.stats())
        return merge_stats(groups)

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
