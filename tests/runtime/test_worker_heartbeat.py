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
