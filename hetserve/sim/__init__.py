"""Discrete-event simulation of a Plan under a workload (see docs/simulator.md).

    from hetserve.sim import simulate, SimOptions
    result = simulate(plan, cluster, model, workload, SimOptions(placement="jsq"))
    result.summary()          # the docs/design.md summary JSON (extended)
    result.save("out/")       # summary.json, requests.csv, latency_cdf.png
"""

from hetserve.sim.metrics import SimResult
from hetserve.policies.predictor import OraclePredictor
from hetserve.sim.simulator import SimOptions, Simulator, simulate
from hetserve.sim.sweep import rate_sweep

__all__ = ["simulate", "SimOptions", "SimResult", "Simulator", "OraclePredictor", "rate_sweep"]
