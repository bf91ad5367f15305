"""Phase 1's spectral order from the device-class quotient (``partition._class_fiedler``): where
the second eigenvalue is simple it is the full eigendecomposition's order; where it repeats (alike
sites), on pools that allow it, a Fiedler vector of the same eigenvalue."""

import random

import numpy as np

from bench.lib.pools import synthetic_pool
from hetserve.planner.context import PlanContext
from hetserve.planner.options import PlanOptions
from hetserve.planner.search import partition as P


def _graph(ctx, devices):
    idx = np.asarray(devices)
    w = ctx.bandwidth_gbps[np.ix_(idx, idx)]
    return (w + w.T) / 2, np.asarray([ctx.class_of[d] for d in devices])


def test_the_quotient_gives_the_full_order_where_the_eigenvalue_is_simple(llama70b, azure):
    ctx = PlanContext(synthetic_pool(64), llama70b, azure, PlanOptions())
    rng = random.Random(0)
    used = 0
    for _ in range(12):
        devices = sorted(rng.sample(range(ctx.num_devices), rng.randint(20, ctx.num_devices)))
        w, labels = _graph(ctx, devices)
        used += P._class_fiedler(w, labels) is not None
        assert (P._laplacian_order(w, labels) == P._laplacian_order(w)).all()
    assert used >= 6


def test_a_repeated_eigenvalue_takes_a_fiedler_vector_only_where_allowed(llama70b, azure):
    ctx = PlanContext(synthetic_pool(320), llama70b, azure, PlanOptions())
    w, labels = _graph(ctx, list(range(ctx.num_devices)))
    assert P._class_fiedler(w, labels) is None  # 11 alike sites: the eigenvalue repeats
    x = P._class_fiedler(w, labels, any_fiedler=True)
    lap = np.diag(w.sum(axis=1)) - w
    second = np.linalg.eigvalsh(lap)[1]
    assert abs(np.linalg.norm(x) - 1) < 1e-9 and abs(x.sum()) < 1e-6
    assert np.allclose(lap @ x, second * x, atol=1e-6 * second)
