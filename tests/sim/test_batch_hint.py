"""A segment's boundary asked at later and later instants (starting from the last answer) agrees
with the same question asked afresh (from the root of ``elapsed``)."""

import random

from hetserve.sim.batch import DecodeBatch


def _batch(t0: float) -> DecodeBatch:
    b = DecodeBatch(lambda size, context: 0.01 + 1e-7 * context)
    for rid in range(8):
        b.add(rid, 100 + rid, 40 + 7 * rid, 140 + 8 * rid)
    b.start(t0)
    return b


def test_hinted_boundaries_match_fresh_ones():
    rng = random.Random(3)
    for t0 in (0.0, 0.7, 1234.5):
        kept = _batch(t0)
        end = t0 + kept.elapsed(kept.k)
        now = t0
        while now < end + 0.05:
            now += rng.choice((1e-4, 3e-3, 0.0101, 0.05, 0.2)) if rng.random() < 0.8 else kept.elapsed(rng.randrange(kept.k)) + t0 - now
            now = max(now, t0)
            fresh = _batch(t0)
            assert kept.boundary_at_or_after(now) == fresh.boundary_at_or_after(now)
            done, nxt = kept.progress(now)
            assert done == fresh.iterations_done(now)
            assert nxt == t0 + fresh.elapsed(done + 1)
