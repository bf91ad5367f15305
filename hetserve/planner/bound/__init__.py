"""Proven upper bounds on what a pool can serve under the cost model: the per-device LP, the group-column programme and its rows, cuts and solvers."""
