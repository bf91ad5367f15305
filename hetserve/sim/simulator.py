"""The simulator: wires a Plan's replicas, the links, the policies and the cost model together.

    arrival ──placement──► prefill (or colocated) replica ──► first token
                                   │ route policy picks a decode replica (plan's KV routes)
                                   ▼
                 decode replica admits when the KV fits ──► KV over the links ──► joins the batch
                                                                                   ▼
                                                                                finished

Public entry point: ``simulate(plan, cluster, model, workload, options) -> SimResult``.
Running time: O((requests + batch-membership changes) · log) events; no event per token in the
default aggregate mode (``pipeline="detailed"`` adds one event per micro-batch per stage).
"""

from __future__ import annotations

import copy
import importlib
import time
from typing import Callable

from hetserve.cost.analytic import CostModel
from hetserve.errors import PlanError
from hetserve.planner.plan import Plan, serves_prefill
from hetserve.planner.validate import check_runnable
from hetserve.policies.batching import token_budget_rule
from hetserve.policies.base import RequestInfo, TransmissionPolicy
from hetserve.policies.kv_admission import pool_tokens
from hetserve.policies.placement import PolicyContext, make_placement
from hetserve.policies.predictor import OraclePredictor
from hetserve.policies.request_checks import RequestRefused, able_to_hold, check_request
from hetserve.policies.routing import make_route, route_candidates
from hetserve.sim.env import BatchLimits
from hetserve.sim.events import EventLoop, Priority
from hetserve.cost.memo import memoised
from hetserve.sim.hosts import FrontEndCost, HostContention
from hetserve.sim.links import Network
from hetserve.sim.metrics import SimResult, result_of
from hetserve.sim.option_checks import DETAILED_PRICES_NEITHER, detailed_unpriced
from hetserve.sim.options import SimOptions
from hetserve.sim.pipeline import PipelineReplica
from hetserve.sim.replicas.colocated import ColocatedReplica
from hetserve.sim.replicas.decode import DecodeReplica
from hetserve.sim.replicas.prefill import PrefillReplica
from hetserve.sim.replicas.base import Replica
from hetserve.sim.replicas.snapshots import SnapshotCache
from hetserve.sim.requests import RequestTable
from hetserve.specs.cluster import Cluster
from hetserve.specs.model import ModelSpec
from hetserve.specs.workload import Workload


def transmission_factory(spec: str | TransmissionPolicy) -> Callable[[], TransmissionPolicy]:
    """A maker of one policy instance per link (MoLink keeps per-link state).

    ``spec``: a name in ``hetserve.policies.transmission.TRANSMISSION_POLICIES`` or a policy object
    (copied for every link).
    """
    if not isinstance(spec, str):
        return lambda: copy.deepcopy(spec)
    try:
        registry = importlib.import_module("hetserve.policies.transmission").TRANSMISSION_POLICIES
    except (ImportError, AttributeError):  # pragma: no cover - the module ships with hetserve
        registry = {}
    if spec in registry:
        return registry[spec]
    raise ValueError(f"unknown transmission policy {spec!r}; choose one of {', '.join(sorted(registry))}")


class Simulator:
    def __init__(self, plan: Plan, cluster: Cluster, model: ModelSpec, workload: Workload,
                 options: SimOptions | None = None, cost: CostModel | None = None):
        self.plan, self.cluster, self.model, self.workload = plan, cluster, model, workload
        self.opts = opts = options or SimOptions()
        if plan.model != model.name:
            raise PlanError(f"plan is for model {plan.model!r}, simulating {model.name!r}")
        check_runnable(plan, cluster, model, source=f"plan for {plan.model!r}")
        self.cost = memoised(cost or CostModel(cluster, model))
        self.max_batch = opts.max_batch or self.cost.eff.max_batch
        budget = token_budget_rule(opts.token_budget, self.max_batch, "max_batch", "chunked_prefill with chunk_tokens")
        if budget is not None:  # the runtime refuses the same (EngineConfig)
            raise ValueError(f"token_budget must be {budget}, got {opts.token_budget}")
        mode = "chunked" if opts.chunked_prefill else opts.prefill_mode
        self.limits = BatchLimits(opts.token_budget, opts.chunk_tokens, mode, self.max_batch,
                                  opts.micro_batches, opts.kv_admission == "paged", opts.kv_block_tokens)
        self.activation_bytes = model.hidden * model.dtype_bytes
        self.loop = EventLoop()
        self.req = RequestTable(workload)
        self.network = Network(cluster.latency, cluster.bandwidth, transmission_factory(opts.transmission), self.loop,
                               paths=cluster.path, overhead_s=opts.link_overhead_s,
                               competing_penalty=opts.link_competing_penalty)
        self.layouts = {r.id: r.layout(cluster) for r in plan.replicas}
        self.replicas: list[Replica] = []
        kinds = {"prefill": PrefillReplica, "decode": DecodeReplica, "colocated": ColocatedReplica}
        for i, r in enumerate(plan.replicas):
            cls = kinds[r.role]
            if opts.pipeline == "detailed" and r.role != "prefill" and len(r.stages) > 1:
                cls = PipelineReplica
                _refuse_choices_in_detail(workload, r.id)
            rep = cls(self, i, r, self.layouts[r.id])
            cap = opts.kv_capacity_tokens
            if isinstance(cap, dict):
                cap = cap.get(r.id)
            if cap is not None:
                rep.kv_capacity = float(cap)
            if rep.kv_capacity <= 0:
                raise PlanError(f"replica {r.id}: the model's weights do not fit its devices "
                                f"(KV capacity {rep.kv_capacity:.0f} tokens)")
            # whole blocks, as the runtime's pool of the same room holds
            rep.kv_capacity = float(pool_tokens(rep.kv_capacity, self.limits.block_size))
            if rep.kv_capacity < 1:
                raise PlanError(f"replica {r.id}: room for less than one KV block of {self.limits.block_size} tokens")
            self.replicas.append(rep)
        self.by_id = {r.id: r for r in self.replicas}
        # the KV pools a request is checked against when it arrives: the largest of each role
        # stands for all of that role (a pool holds a request iff its room is at least the request's
        # reservation, so some pool of a role holds it iff the largest does)
        pools = [(r.role, r.kv_capacity) for r in self.replicas]
        self._pools = [(role, max(cap for rl, cap in pools if rl == role))
                       for role in dict.fromkeys(rl for rl, _ in pools)]
        self._smallest_pool = min((cap for _, cap in pools), default=0)
        self.hosts = HostContention(self.replicas, cluster, self.loop, opts.contention_slowdown,
                                    FrontEndCost(opts.frontend_request_cpu_s, opts.frontend_step_cpu_s,
                                                 opts.frontend_token_cpu_s, opts.frontend_dispatch_s,
                                                 opts.stream_step_overhead_s),
                                    opts.micro_batches)
        self.entry = [r for r in self.replicas if serves_prefill(r.role)]
        self._routes: dict[str, list[tuple[Replica, float]]] = {}
        decoders = [r.id for r in self.replicas if r.role == "decode"]
        for rep in self.replicas:
            if rep.role != "prefill":
                continue
            self._routes[rep.id] = [(self.by_id[d], w) for d, w in route_candidates(plan, rep.id, decoders)]
        self._kv_pairs: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
        self._set_capacity_norms()
        ctx = PolicyContext.for_plan(plan, cluster, model, workload, slo=opts.slo, seed=opts.seed,
                                     options=opts.policy_options, predictor=opts.predictor, cost=self.cost,
                                     layouts=self.layouts)
        self.placement = make_placement(opts.placement, ctx) if isinstance(opts.placement, str) else opts.placement
        self.router = make_route(opts.route, ctx) if isinstance(opts.route, str) else opts.route
        self.predictor = opts.predictor if opts.predictor is not None else OraclePredictor(self.req.out)
        self._placement_needs_requests = bool(getattr(self.placement, "needs_requests", False))
        self._route_needs_requests = bool(getattr(self.router, "needs_requests", False))
        self._route_on_finish = getattr(self.router, "on_finish", None)  # looked up once: a miss raises inside
        # placement snapshots kept between arrivals and rebuilt where a replica changed: the calls
        # into an entry replica below touch it; its own events mark it (``SnapshotCache``). Filed
        # by load for a placement that reads the least loaded alone
        # (``PlacementPolicy.picks_least_loaded``; ``_ranked_for``: the policy the cache files for)
        by_load = bool(getattr(self.placement, "picks_least_loaded", False))
        self._snaps = (None if self._placement_needs_requests else
                       SnapshotCache(self.entry, waits=bool(getattr(self.placement, "reads_waits", True)),
                                     by_load=by_load))
        self._ranked_for = self.placement if by_load and self._snaps is not None else None
        self._repredicted: dict[int, float] = {}
        self.completed = 0
        self.rejected = 0
        self.wall_s = 0.0

    # ------------------------------------------------------------------ setup helpers
    def slowdown(self, rep: Replica, own_workers: float | None = None) -> float:
        """Factor on the work ``rep`` starts now: CPU worker slots sharing their host's cores with
        the other busy replicas and the serving front end there (``sim.hosts``); 1 off CPU slots."""
        return self.hosts.slowdown(rep, own_workers)

    def host_changed(self, rep: Replica) -> None:
        """``rep`` started or ended work on a host with shared cores: its neighbours re-price (``sim.hosts``)."""
        self.hosts.changed(rep)

    def dispatch_wait(self, rep: Replica, decodes: bool = True) -> float:
        """Seconds ``rep``'s next step waits for the serving front end (``sim.hosts``)."""
        return self.hosts.dispatch_wait(rep, decodes)

    def _set_capacity_norms(self) -> None:
        """Relative capacity per role: the plan's own share where its estimate has one (requests
        per period each replica was planned to serve: what the planner's throughput assumes),
        else prefill by 1/TTFT at the mean prompt, decoders by tokens/s."""
        wl, c = self.workload, self.cost
        mi, mo = max(1.0, wl.mean_input), max(1.0, wl.mean_output)
        planned = self.plan.estimate.get("replicas", {}) if isinstance(self.plan.estimate, dict) else {}
        raw, from_plan = {}, set()
        for r in self.replicas:
            share = planned.get(r.id, {})
            share = share.get("flow_requests_per_period", share.get("capacity_requests_per_period"))
            if isinstance(share, (int, float)) and share > 0:
                raw[r.id] = float(share)
                from_plan.add(r.id)
            elif r.role == "prefill":
                raw[r.id] = 1.0 / c.ttft(r.layout, round(mi))
            else:
                raw[r.id] = c.decode_throughput(r.layout, mi, mo)[1] or 1e-9
        # Prefill and colocated replicas are placement candidates side by side: where the plan gives
        # every one a share (requests per period, one unit) they are normalised together, else a
        # colocated replica would rank as high as the top prefill one and draw several times its share.
        entry = [r for r in self.replicas if r.role in ("prefill", "colocated")]
        same_unit = bool(entry) and all(r.id in from_plan for r in entry)
        groups = (("prefill", "colocated"), ("decode",)) if same_unit else (("prefill",), ("decode",), ("colocated",))
        for roles in groups:
            group = [r for r in self.replicas if r.role in roles]
            if group:
                top = max(raw[r.id] for r in group)
                for r in group:
                    r.capacity_norm = raw[r.id] / top

    # ------------------------------------------------------------------ run
    def run(self) -> SimResult:
        n = self.req.n
        t0 = time.perf_counter()
        if n:
            self.loop.schedule(self.req.arrival[0] + self.opts.request_overhead_s, Priority.ARRIVAL, self._on_arrival, 0)
        if self.opts.progress and n:
            from rich.progress import Progress
            with Progress(transient=True) as bar:
                task = bar.add_task(f"simulating {n} requests", total=n)
                self.loop.run(on_progress=lambda: bar.update(task, completed=self.completed + self.rejected))
        else:
            self.loop.run()
        self.wall_s = time.perf_counter() - t0
        if self.completed + self.rejected != n:  # an internal invariant: nothing admitted is ever dropped
            raise RuntimeError(f"simulation ended with {n - self.completed - self.rejected} of {n} requests unfinished")
        return self._result()

    # ------------------------------------------------------------------ request path
    def _on_arrival(self, rid: int) -> None:
        r = self.req
        if rid + 1 < r.n:
            self.loop.schedule(r.arrival[rid + 1] + self.opts.request_overhead_s, Priority.ARRIVAL, self._on_arrival,
                               rid + 1)
        # one that fits the smallest pool fits every pool: the KV check cannot refuse it (the plan
        # has replicas on each side, ``check_runnable``)
        may_not_fit = self._may_not_fit(rid)
        if not self._admissible(rid, kv=may_not_fit):
            return
        self.hosts.on_arrival()
        pred = float(self.predictor.predict(rid, r.inp[rid], 0))
        r.pred[rid] = pred
        info = RequestInfo(rid, r.arrival[rid], r.inp[rid], pred)
        snaps, placement = self._snaps, self.placement
        if placement is self._ranked_for and not may_not_fit:
            choice = placement.choose_lowest(info, snaps.lowest(), self.loop.now)  # type: ignore[attr-defined,union-attr]
        else:
            cands = snaps.states() if snaps is not None else [e.state(True) for e in self.entry]
            if may_not_fit:
                cands = able_to_hold(cands, r.inp[rid], r.out[rid], self.limits.block_size)
            choice = placement.choose(info, cands, self.loop.now)
        chosen = self.by_id[choice]
        r.prefill_rep[rid] = chosen.index
        chosen.place(rid)  # type: ignore[attr-defined]
        self._touch(chosen)

    def _may_not_fit(self, rid: int) -> bool:
        """Whether request ``rid`` could exceed some replica's pool: its reservation is at most its
        prompt, output and one block more (the arrival checks the KV pools, and placement filters by
        ``able_to_hold``, only then)."""
        r = self.req
        return r.inp[rid] + r.out[rid] + self.limits.block_size > self._smallest_pool

    def _touch(self, rep: Replica) -> None:
        if self._snaps is not None:
            self._snaps.touch(rep)

    def _admissible(self, rid: int, kv: bool = True) -> bool:
        """Check the request as the engine checks a submitted one (``policies.request_checks``):
        one it refuses is recorded as rejected here and never placed. ``kv`` False: the KV pools
        are known to hold it (the check is skipped)."""
        r = self.req
        try:
            check_request(r.inp[rid], r.out[rid], self.model.max_context, self._pools, self.limits.block_size,
                          context=self.opts.beyond_context == "reject", kv=kv)
        except RequestRefused as exc:
            r.rejected[rid] = exc.reason
            self.rejected += 1
            return False
        return True

    def _result(self) -> SimResult:
        links = self.network.links
        return result_of(
            self.req, self.replicas, self.opts.slo, self.plan, self.cluster,
            info={"plan": self.plan.algorithm, "cluster": self.cluster.name, "model": self.model.name,
                  "workload": self.workload.name, "placement": getattr(self.placement, "name", "?"),
                  "route": getattr(self.router, "name", "?"),
                  "transmission": self.network.policy_name,
                  "predictor": getattr(self.predictor, "name", type(self.predictor).__name__),
                  "pipeline": self.opts.pipeline, "chunked_prefill": self.opts.chunked_prefill,
                  "prefill_mode": self.limits.prefill_mode, "token_budget": self.opts.token_budget,
                  "kv_admission": self.opts.kv_admission, "request_overhead_s": self.opts.request_overhead_s,
                  "preemptions": sum(getattr(x, "preemptions", 0) for x in self.replicas),
                  "policy_options": {k: v for k, v in self.opts.policy_options.items()
                                     if isinstance(v, (bool, int, float, str))},
                  "policy_stats": {name: dict(st) for name, pol in (("placement", self.placement),
                                                                     ("route", self.router))
                                   if isinstance(st := getattr(pol, "stats", None), dict)},
                  "events": self.loop.events, "wall_s": self.wall_s,
                  # per GPU type of the plan (not the pool's unused ones): fitted / transferred / roofline
                  "pricing": self.cost.pricing(self.cluster.device(d).index for d in self.plan.devices),
                  # per sending resource (NIC out, or a private in-box pair) of the shared link model
                  "links": {name: {"bytes": sum(q.bytes_sent.values()), "busy_s": q.busy_s,
                                   "messages": sum(q.messages.values())}
                            for name, q in sorted(links.items())} if len(links) <= 64 else {}})

    # ------------------------------------------------------------------ ReplicaEnv
    def first_token(self, rid: int) -> None:
        self.req.t_first[rid] = self.loop.now

    def prefill_done(self, rid: int, src: PrefillReplica) -> None:
        r = self.req
        if not r.made[rid]:  # a recompute (paged KV) streamed its first token long ago
            r.t_first[rid] = self.loop.now
        if r.made[rid] + 1 >= r.out[rid]:  # the prefill produced the last token: no KV hand-off
            src.release(rid)
            self._touch(src)
            self.finished(rid)
            return
        routes = self._routes[src.id]
        if len(routes) == 1:
            dst = routes[0][0]
        else:
            info = RequestInfo(rid, r.arrival[rid], r.inp[rid], r.pred[rid])
            cands = [(d.state(self._route_needs_requests), w) for d, w in routes]
            if self._may_not_fit(rid):
                fit = {c.id for c in able_to_hold([c for c, _ in cands], r.inp[rid], r.out[rid],
                                                  self.limits.block_size, decoding=True)}
                cands = [(c, w) for c, w in cands if c.id in fit]
            dst = self.by_id[self.router.choose(info, src.id, cands, self.loop.now)]
        r.decode_rep[rid] = dst.index
        dst.enqueue(rid, src)  # type: ignore[attr-defined]

    def start_kv(self, rid: int, src: PrefillReplica, dst: Replica) -> None:
        """Move the prompt's KV from ``src`` to ``dst`` over the links of matched device pairs."""
        key = (src.index, dst.index)
        pairs = self._kv_pairs.get(key)
        if pairs is None:  # bytes per token for each device pair, merged per pair
            merged: dict[tuple[int, int], float] = {}
            for d, e, b in self.cost.kv_transfer_pairs(src.layout, dst.layout, 1.0):
                merged[(d, e)] = merged.get((d, e), 0.0) + b
            pairs = self._kv_pairs[key] = [(d, e, b) for (d, e), b in merged.items()]
        r = self.req
        # each choice's KV goes in a hand-off of its own; a recompute brings what it had made too
        tokens = r.choices[rid] * (r.inp[rid] + r.made[rid])
        r.t_kv_start[rid] = self.loop.now

        def done(_start: float, rid=rid, tokens=tokens) -> None:
            r.t_kv_done[rid] = self.loop.now
            src.release(rid)
            self._touch(src)
            dst.kv_arrived(rid)  # type: ignore[attr-defined]

        self.network.send("kv", [(d, e, b * tokens) for d, e, b in pairs], done)

    def recompute(self, rid: int) -> None:
        rep = self.replicas[self.req.prefill_rep[rid]]
        rep.requeue(rid)  # type: ignore[attr-defined]
        self._touch(rep)

    def finished(self, rid: int) -> None:
        r = self.req
        r.t_finish[rid] = self.loop.now
        self.completed += 1
        self._repredicted.pop(rid, None)
        self.placement.on_finish(rid, r.inp[rid], r.out[rid])
        on_finish = self._route_on_finish
        if on_finish is not None:
            on_finish(rid, r.inp[rid], r.out[rid])
        self.predictor.observe(rid, r.inp[rid], r.out[rid])

    def repredict(self, rid: int, generated: int) -> float:
        """The request's predicted output, re-asked once it has outlived the prediction."""
        pred = self._repredicted.get(rid, self.req.pred[rid])
        if generated >= pred:
            pred = max(float(self.predictor.predict(rid, self.req.inp[rid], generated)), generated + 1.0)
            self._repredicted[rid] = pred
        return pred


def _refuse_choices_in_detail(workload: Workload, replica: str) -> None:
    """A trace the stage-by-stage pipeline cannot price is refused there, not simulated as plain requests."""
    many, scored = detailed_unpriced(workload)
    if many or scored:
        raise ValueError(f"pipeline='detailed' (replica {replica}): {DETAILED_PRICES_NEITHER}, and {workload.name} "
                         f"has {many} requests with n > 1 and {scored} scoring their prompt; use "
                         f"pipeline='aggregate' (--pipeline aggregate)")


def simulate(plan: Plan, cluster: Cluster, model: ModelSpec, workload: Workload,
             options: SimOptions | None = None, cost: CostModel | None = None) -> SimResult:
    """Play ``workload`` against ``plan`` and return per-request timings and the summary.

    Times come from ``cost`` (default: the analytic ``CostModel`` of cluster and model).
    Running time: about linear in the number of requests; see docs/simulator.md.
    """
    return Simulator(plan, cluster, model, workload, options, cost).run()

