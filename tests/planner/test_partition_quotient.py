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


def _rotated_eigh(angle):
    """``numpy.linalg.eigh`` with the basis of a repeated second eigenvalue turned by ``angle``:
    as valid an answer as numpy's own, and what another CPU's BLAS kernels may give."""
    eigh = np.linalg.eigh

    def turned(a):
        vals, vecs = eigh(a)
        same = np.flatnonzero(np.abs(vals - vals[1]) <= 1e-9 * max(1.0, abs(vals[-1])))
        if len(same) >= 2:
            i, j = same[0], same[1]
            c, s = np.cos(angle), np.sin(angle)
            vecs = vecs.copy()
            vecs[:, i], vecs[:, j] = c * vecs[:, i] - s * vecs[:, j], s * vecs[:, i] + c * vecs[:, j]
        return vals, vecs

    return turned


def test_a_repeated_eigenvalue_gives_one_order_whatever_basis_eigh_returns(monkeypatch):
    """Three alike boxes of two GPUs, alike links between them: the second eigenvalue repeats,
    and the order (so the partition and the plan) must not depend on which basis of its
    eigenspace ``eigh`` returns, which differs between CPUs."""
    w = np.full((6, 6), 10.0)
    for box in range(3):
        w[2 * box, 2 * box + 1] = w[2 * box + 1, 2 * box] = 600.0
    np.fill_diagonal(w, 0.0)
    lap = np.diag(w.sum(axis=1)) - w
    vals = np.linalg.eigvalsh(lap)
    assert abs(vals[1] - vals[2]) < 1e-9  # the case this test is about
    want = P._laplacian_order(w)
    for angle in (0.3, 1.1, 2.0, 3.0):
        monkeypatch.setattr(P.np.linalg, "eigh", _rotated_eigh(angle))
        assert (P._laplacian_order(w) == want).all(), angle
