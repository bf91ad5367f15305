"""Discrete-event simulation of a Plan under a workload (see docs/simulator.md).

    from hetserve.sim import simulate, SimOptions
    result = simulate(plan, cluster, model, workload, SimOptions(placement="jsq"))
    result.summary()          # the docs/design.md summary JSON (extended)
    result.save("out/")       # summary.json, requests.csv, latency_cdf.png

The names below are imported when first asked for: a caller that needs one light module of the
package (``hetserve serve`` checks its options with ``sim.option_checks``) does not load the
simulator, its policies and SciPy (most of a second of a server's start).
"""

from importlib import import_module

_HOME = {"SimResult": "hetserve.sim.metrics", "OraclePredictor": "hetserve.policies.predictor",
         "SimOptions": "hetserve.sim.simulator", "Simulator": "hetserve.sim.simulator",
         "simulate": "hetserve.sim.simulator", "rate_sweep": "hetserve.sim.sweep"}

__all__ = ["simulate", "SimOptions", "SimResult", "Simulator", "OraclePredictor", "rate_sweep"]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(home), name)
    return value
