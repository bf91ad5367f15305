"""Capacity planning and scaling (Aladdin §4.1, §5.2): above the simulator in the layering.

* ``config``  — GPUs per worker maximising per-GPU decode throughput under the SLOs (Eq. 6);
* ``workers`` — the fewest workers meeting the SLOs at an arrival rate (simulated, or a fluid lower
  bound from the cost model), and the law N_w = ⌈k5·r + c5⌉ fitted over rates (Eq. 7);
* ``scaling`` — the worker count over a time-varying trace, re-decided at each heartbeat.
"""

from hetserve.capacity.config import WorkerOption, best_worker_config, homogeneous_cluster, worker_options
from hetserve.capacity.scaling import ScalingPlan, ScalingStep, plan_scaling
from hetserve.capacity.workers import WorkerLaw, fit_worker_law, fluid_workers, min_workers

__all__ = ["WorkerOption", "best_worker_config", "homogeneous_cluster", "worker_options", "ScalingPlan",
           "ScalingStep", "plan_scaling", "WorkerLaw", "fit_worker_law", "fluid_workers", "min_workers"]
