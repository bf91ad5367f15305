"""A worker's heartbeat thread (``worker_process._heartbeat``): the beats go on whatever the link
report beside them does, since the engine declares a worker that stops beating dead."""

from __future__ import annotations

import collections
import logging

from hetserve.runtime.workers import worker_process


class RecordingTransport:
    """What ``_heartbeat`` uses of a transport: records each message sent, closes after ``beats`` beats."""

    def __init__(self, beats: int):
        self.beats, self.closed, self.rejected = beats, False, collections.Counter()
        self.sent: list[str] = []

    def send(self, peer, msg, priority=None):
        self.sent.append(msg.kind)
        if self.sent.count("heartbeat") == self.beats:
            self.closed = True


class BrokenCounters:
    """A link scheduler hook whose counters cannot be read."""

    def __init__(self):
        self.calls = 0

    def process_stats(self):
        self.calls += 1
        raise RuntimeError("counters unreadable")


def test_a_link_report_that_raises_leaves_the_heartbeats_going_and_is_logged_once(caplog):
    transport, hook = RecordingTransport(beats=5), BrokenCounters()
    with caplog.at_level(logging.WARNING, logger="hetserve.runtime.workers.worker_process"):
        worker_process._heartbeat(transport, "m0:0", 0.0, None, hook)  # returns once the transport closes
    assert transport.sent == ["heartbeat"] * 5 and hook.calls == 5
    assert [r.getMessage() for r in caplog.records if "link report failed" in r.getMessage()] == [
        "m0:0: its link report failed (RuntimeError: counters unreadable); heartbeats go on without it, "
        "later failures are not logged"]


class _Workers:
    """What ``Recovery._poll_workers`` reads of a worker group: two workers, ``exits`` as
    ``(name, exit code)`` in the order the group lists them."""

    procs = {"m0:0": None, "m0:1": None}

    def __init__(self, exits=()):
        self.exits, self.dead = list(exits), set()

    def reap(self):
        pass

    def exited(self):
        return self.exits

    def exit_reason(self, name, code):
        return f"died with exit code {code}"


def _poller(last_poll_ago: float, silent_s: float, exits=()):
    from types import SimpleNamespace
    import time

    from hetserve.runtime.recovery import Recovery

    now = time.monotonic()
    deaths = []
    workers = _Workers(exits)

    def death(name, what):  # the first death takes the replica: its other workers with it
        deaths.append(name)
        workers.dead |= set(_Workers.procs)

    loop = SimpleNamespace(workers=workers, heartbeat_timeout_s=3.0, empty_since=None,
                           _last_poll=now - last_poll_ago, last_beat={n: now - silent_s for n in _Workers.procs},
                           _on_worker_death=death)
    Recovery._poll_workers(loop)
    return deaths


def test_the_worker_a_signal_ended_is_named_not_its_peer_that_lost_the_connection():
    assert _poller(last_poll_ago=0.2, silent_s=0.0, exits=[("m0:0", 1), ("m0:1", -9)]) == ["m0:1"]


def test_a_silent_worker_is_declared_dead_when_the_engine_kept_polling():
    assert _poller(last_poll_ago=0.2, silent_s=5.0) == ["m0:0"]  # its replica's other worker goes with it


def test_after_the_engine_itself_stood_still_no_worker_is_blamed():
    """The engine's process stopped (SIGSTOP) or starved for longer than the heartbeat timeout: the
    beats of that time are unread, not missing, so its workers' silence counts from now."""
    assert _poller(last_poll_ago=5.0, silent_s=5.0) == []
