"""Event ordering: (time, priority, seq), and what that means for the simulator."""

import pytest

from hetserve.sim.events import EventLoop, Priority


def test_same_time_orders_by_priority_then_insertion():
    loop, seen = EventLoop(), []
    loop.schedule(1.0, Priority.SCHEDULE, seen.append, "schedule")
    loop.schedule(1.0, Priority.ARRIVAL, seen.append, "arrival-1")
    loop.schedule(1.0, Priority.WORK, seen.append, "work")
    loop.schedule(1.0, Priority.ARRIVAL, seen.append, "arrival-2")
    loop.schedule(1.0, Priority.LINK, seen.append, "link")
    loop.schedule(0.5, Priority.SCHEDULE, seen.append, "earlier")
    loop.run()
    assert seen == ["earlier", "link", "work", "arrival-1", "arrival-2", "schedule"]
    assert loop.now == 1.0 and loop.events == 6


def test_events_scheduled_by_a_handler_at_the_same_time_respect_priority():
    loop, seen = EventLoop(), []

    def arrive(_):
        seen.append("arrival")
        loop.schedule(loop.now, Priority.SCHEDULE, seen.append, "decide")
        loop.schedule(loop.now, Priority.ARRIVAL, seen.append, "second arrival")

    loop.schedule(2.0, Priority.ARRIVAL, arrive)
    loop.run()
    assert seen == ["arrival", "second arrival", "decide"]


def test_scheduling_in_the_past_is_an_error():
    loop = EventLoop()
    loop.schedule(1.0, Priority.WORK, lambda _: loop.schedule(0.5, Priority.WORK, print))
    with pytest.raises(ValueError, match="past"):
        loop.run()
