"""The testbed of experiment 3 (Aladdin Figures 11 and 12) and what every section shares.

``Setting`` holds one testbed (model, GPU, in-box link, SLOs, ShareGPT lengths); ``aladdin`` makes
the Aladdin policy per pool; ``needed`` counts the GPUs a policy needs by bisection — the one way
every policy is counted; ``trace_windows`` cuts disjoint trace windows; ``table`` prints the
markdown tables. The sections themselves live in ``aladdin_figures.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from hetserve.capacity.config import homogeneous_cluster, worker_options
from hetserve.capacity.simulated import workers_needed
from hetserve.capacity.workers import fluid_workers
from hetserve.errors import InfeasibleError
from hetserve.policies.aladdin import AladdinPlacement
from hetserve.policies.aladdin_models import models_from_cost
from hetserve.policies.grouped import GroupedPlacement, split_groups
from hetserve.policies.predictor import BucketMeanPredictor
from hetserve.specs.workload import SLO, Workload, load_workload

MODEL = "llama-2-13b"
A100, V100 = "A100-SXM-80G", "V100-32G"
PCIE = {"bandwidth_gbps": 200, "latency_ms": 0.01}  # the aladdin-a100 preset's in-box link
SLO_A100 = SLO(ttft_s=0.6, tpot_s=0.03)  # Aladdin Table 2, 13B on A100
SLO_V100 = SLO(ttft_s=0.8, tpot_s=0.05)  # Aladdin Table 2, 13B on V100
PAPER = {
    "colocated": "Figure 11: Aladdin needs up to 71% fewer GPUs than default vLLM and up to 40% fewer than "
                 "JSQ with Aladdin's worker size (read off a plot; no table in the paper)",
    "decode": "Figure 12: Aladdin needs up to 60% fewer decode GPUs than JSQ and up to 49% fewer than "
              "power-of-two",
}


@dataclass
class Setting:
    """One testbed: model, GPU, in-box link, SLOs and the ShareGPT lengths."""

    gpu: str
    slo: SLO
    intra: dict | None
    base: Workload
    history: Workload  # held-out requests the bucket predictor learns from
    requests: int
    target: float
    kv: str
    seed: int
    model: object = field(repr=False, default=None)
    prefill_mode: str = "prefill_first"  # vLLM's, as the paper ran it: a prompt step pauses decoding

    def poisson(self, rate: float) -> Workload:
        return self.base.with_poisson_arrivals(rate, self.seed).head(self.requests)

    def bucket(self):
        fitted = BucketMeanPredictor().fit(self.history.input_tokens, self.history.output_tokens)
        return lambda: copy.deepcopy(fitted)

    def option(self, g: int, mode: str):
        pool8 = homogeneous_cluster(self.gpu, 8, 4, self.intra)
        mi, mo = self.base.mean_input, self.base.mean_output
        return next(o for o in worker_options(pool8, self.model, self.slo, mi, mo, degrees=(g,), gpu_name=self.gpu))

    def fluid(self, rate: float, g: int, mode: str) -> int:
        o = self.option(g, mode)
        return fluid_workers(rate, o, self.base.mean_input, self.base.mean_output, colocated=mode == "colocated")


def aladdin(slo: SLO, gamma: float = 1.0, theta: float = 1.0, rebalance: bool = True, groups: int = 1,
            made: list | None = None, overflow: str = "least_overdraft"):
    """A policy maker for ``run_pool``: Aladdin with coefficients fitted per pool (grouped when
    ``groups`` > 1); every policy made is appended to ``made`` (to read its stats)."""
    def make(pool):
        layouts = {r.id: r.layout(pool.cluster) for r in pool.plan.replicas if r.id in pool.worker_ids}
        models = models_from_cost(pool.cost, layouts, slo)

        def one(ids):
            return AladdinPlacement({i: models[i] for i in ids}, slo, gamma=gamma, theta=theta, rebalance=rebalance,
                                    overflow=overflow)
        pol = one(pool.worker_ids) if groups == 1 else GroupedPlacement(
            split_groups(pool.worker_ids, min(groups, len(pool.worker_ids))), one)
        if made is not None:
            made.append(pol)
        return pol
    return make


def needed(s: Setting, rate: float, policy, g: int, mode: str = "colocated", predictor=None,
           wl: Workload | None = None) -> int | None:
    """Fewest GPUs (workers × g) meeting the target, or None past 4× the fluid bound + 8 workers."""
    fluid = s.fluid(rate, g, mode)
    prefill = max(2, s.fluid(rate, g, "colocated")) if mode == "decode" else 0
    slo = s.slo if mode == "colocated" else SLO(ttft_s=None, tpot_s=s.slo.tpot_s)
    try:
        n = workers_needed(s.model, s.gpu, wl or s.poisson(rate), slo, policy, g, mode, s.target,
                           prefill_workers=prefill, intra=s.intra, hint=fluid, max_workers=4 * fluid + 8,
                           predictor_factory=predictor, kv_admission=s.kv, prefill_mode=s.prefill_mode)
    except InfeasibleError:
        return None
    return n * g


def cell(x: int | None, cap: str = "—") -> str:
    return str(x) if x is not None else cap


def saving(a: int | None, j: int | None) -> str:
    return f"{100 * (1 - a / j):+.0f}%" if a and j else "—"


def table(title: str, rates: list[float], rows: dict[str, list]) -> None:
    print(f"### {title}\n")
    print("| policy | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    for name, cells in rows.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()


def trace_windows(s: Setting, trace: str, rate: float, windows: int) -> list[Workload]:
    """``windows`` disjoint windows of ``s.requests`` requests at ``rate``: consecutive slices of the
    ShareGPT lengths with Poisson arrivals (seed ``s.seed`` + k), or consecutive slices of the Azure
    conversation trace with its own (bursty) arrivals rescaled to ``rate``. Fewer if the file runs out."""
    src = s.base if trace == "sharegpt" else load_workload("azure-conv").filter_lengths(2048, 2048)
    k_max = max(1, min(windows, len(src) // s.requests))
    out = []
    for k in range(k_max):
        w = src._take(np.arange(k * s.requests, (k + 1) * s.requests), src.name)
        out.append(w.with_poisson_arrivals(rate, s.seed + k) if trace == "sharegpt" else w.with_rate(rate))
    return out
