"""``jsq`` among many equally loaded candidates reads the outstanding tokens of only those whose
lower bound (``ReplicaState.outstanding_at_least``) does not rule them out, and chooses as reading
every one would: the same replica, ties round robin in candidate order."""

import random

from hetserve.policies import placement
from hetserve.policies.base import ReplicaState
from hetserve.policies.outstanding import SnapshotsLeastLoaded
from hetserve.policies.placement import _fewest_tokens

NOW = 10.0


def _snapshot(rng: random.Random, i: int, few: bool) -> ReplicaState:
    """Outstanding tokens from a wide range, or (``few``) from three values so candidates tie;
    a bound of each kind, true or loose, or none."""
    out = rng.choice((100.0, 250.0, 400.0)) if few else rng.random() * 1000
    s = ReplicaState(f"r{i}", "colocated", 1, 2, 0, out, 0, 0, 0)
    kind = rng.randrange(4)
    if kind == 1:
        object.__setattr__(s, "outstanding_floor", out * rng.choice((1.0, rng.random())))
    elif kind >= 2:
        since, rate = rng.random() * NOW, rng.random() * 100
        slack = 1e-9 * out if kind == 2 else rng.random() * 50  # tight but for rounding, as the simulator's
        object.__setattr__(s, "outstanding_drain", (since, out + rate * (NOW - since) - slack, rate))
    return s


def _plain(lowest, turn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(placement, "BOUND_FROM", 10**9)
        return _fewest_tokens(SnapshotsLeastLoaded(lowest, NOW), turn)


def test_the_bounded_choice_is_the_plain_one(monkeypatch):
    rng, bounded = random.Random(3), 0
    for turn in range(3000):
        few = turn % 2 == 0
        lowest = [_snapshot(rng, i, few) for i in range(rng.randrange(2, 30))]
        got = _fewest_tokens(SnapshotsLeastLoaded(lowest, NOW), turn)
        assert got == _plain(lowest, turn, monkeypatch)
        bounded += len(lowest) >= placement.BOUND_FROM
    assert bounded > 1000


def test_snapshots_below_their_floor_are_all_read(monkeypatch):
    # a snapshot whose tokens went negative breaks the default floor (0): no bound is trusted
    lowest = [ReplicaState(f"r{i}", "colocated", 1, 2, 0, -5.0 - i % 3, 0, 0, 0) for i in range(12)]
    for turn in range(4):
        assert _fewest_tokens(SnapshotsLeastLoaded(lowest, NOW), turn) == _plain(lowest, turn, monkeypatch)
