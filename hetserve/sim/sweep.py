"""Rate sweeps: the same plan and trace at several mean arrival rates."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hetserve.cost.analytic import CostModel
from hetserve.planner.plan import Plan
from hetserve.sim.simulator import SimOptions, simulate
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload


def rate_sweep(plan: Plan, cluster: Cluster, model: ModelSpec, workload: Workload, rates: Sequence[float],
               options: SimOptions | None = None, cost: CostModel | None = None, label: str = "",
               plot: str | Path | None = None, source: str | None = None,
               plot_title: str | None = None) -> list[dict]:
    """Simulate ``workload`` rescaled to each mean rate (req/s, burst shape kept); a ``SpecError``
    naming ``source`` (default: the workload's name) if its arrivals have no spacing to rescale.

    Returns rows ``{"label", "rate", "summary"}``; with ``plot``, also writes throughput and SLO
    attainment against rate to that PNG, titled ``plot_title`` (default: the runs' cost-model
    pricing). Running time: one simulation per rate.
    """
    cost = cost or CostModel(cluster, model)
    rows = []
    for rate in rates:
        res = simulate(plan, cluster, model, workload.with_rate(rate, source=source, option="--sweep-rates"), options, cost)
        rows.append({"label": label, "rate": float(rate), "summary": res.summary()})
    if plot is not None:
        from hetserve.sim.plots import plot_rate_sweep
        plot_rate_sweep(rows, plot, title=plot_title)
    return rows
