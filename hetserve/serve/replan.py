"""``Replanner``: elastic re-plan of a serving engine — on demand (``POST /admin/replan``) or on failure.

A re-plan asks the planner (``planner.replan``, warm-started from the running plan: the replicas
that still run keep running) for a plan of the devices no live replica holds, then moves the engine
to it (``Engine.reconfigure``: the unchanged replicas keep serving while the new ones start).
Devices whose worker died are *lost* until a re-plan names them ``returned`` (they came back) or an
updated cluster file is given; a cluster file may also add devices, which join the same way.

With ``on_failure`` a watcher thread re-plans as soon as the engine reports a dead replica, and
records how long each part took: detection (death -> noticed), planning, retiring, starting the new
workers, and the whole "failure -> new plan serving". A re-plan whose new workers fail to start is
tried again (trigger ``retry``), their devices counted lost, after a back-off (``RETRY_FIRST_S``
doubling up to ``RETRY_MAX_S``, at most ``RETRIES`` times), until one serves, an operator's re-plan
serves first, or the shutdown stops the retries (``stop_retries``). Each try is counted, logged once
and kept in ``history``, failed ones too (``outcome``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from hetserve.errors import HetserveError, PlanError, WorkerStartFailure

log = logging.getLogger("hetserve.serve")

# how much longer than the planner's time limit requests wait, with no replica left, for the
# re-plan's replicas: their workers start and load (seconds on a CPU, a minute or more on GPUs)
HOLD_MARGIN_S = 120.0
# plans made per re-plan when workers die while the planner runs: each death planned around costs a
# search (up to the time limit), so a cascade of deaths is left to the watcher's next re-plan
PLAN_TRIES = 3
# a failure's re-plan whose new workers failed to start is tried again after RETRY_FIRST_S, doubling up
# to RETRY_MAX_S, RETRIES times at most: the freed devices would otherwise stay idle until an operator
# re-plans, and a start-up that fails for a passing cause (a port taken, memory held by a process
# exiting) often works a few seconds later; the devices whose workers failed are lost meanwhile, so the
# next try plans around them rather than onto the same failure
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
RETRIES = 8


class ReplanInputError(PlanError):
    """A re-plan request naming devices it cannot take; ``param``: the body field that named them
    (``lost`` or ``returned``), which the HTTP answer names too."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _requested_cluster(path_or_preset: str):
    """The cluster a re-plan request names. Its refusal names the field and what was expected, never
    the value found: the path comes from an HTTP request, and the server may read files its caller
    may not (a YAML file of secrets would be echoed back one value at a time). The log has it whole."""
    from hetserve.errors import SpecError
    from hetserve.specs.cluster import load_cluster

    try:
        return load_cluster(path_or_preset)
    except SpecError as exc:
        log.warning("re-plan: cluster %r refused: %s", path_or_preset, exc)
        where = "" if exc.field in ("(file)", "(top level)", "(cluster)") else f"field '{exc.field}': "
        raise ReplanInputError(f"cluster {path_or_preset!r}: {where}expected {exc.expected}", "cluster") from None


def role_changes(planned: dict[str, str], live: dict[str, str], replanned: dict[str, list[str]],
                 kept: list[str]) -> dict[str, list[str]]:
    """Each kept replica whose role moved since the last plan, as its roles in order: the plan's, the
    one it ran when the re-plan began (a worker's death switches roles in place: ``runtime.recovery``),
    and the one the re-plan gave it (``replanned``: ``Engine.reconfigure``'s ``roles``, from and to).
    ``/health`` shows the last; a replica with none of these changes is left out."""
    out = {}
    for rid in kept:
        chain = [planned.get(rid), live.get(rid), replanned.get(rid, [None, None])[1]]
        chain = [r for r in chain if r is not None]
        chain = [r for i, r in enumerate(chain) if i == 0 or r != chain[i - 1]]
        if len(chain) > 1:
            out[rid] = chain
    return out


class Replanner:
    def __init__(self, engine, workload: str = "azure-conv", algorithm: str = "hexgen2",
                 time_limit_s: float = 10.0, seed: int = 0, on_failure: bool = False):
        self.engine = engine
        self.workload, self.algorithm, self.time_limit_s, self.seed = workload, algorithm, time_limit_s, seed
        self.lost: set[str] = set()
        self.history: list[dict[str, Any]] = []
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()  # (trigger, done | failed)
        self._lock = threading.Lock()
        self._seen_deaths = 0
        self._stop = threading.Event()
        self._no_retries = threading.Event()  # set by the shutdown: a failed re-plan is not tried again
        self._thread = None
        if on_failure:
            # the workload is checked now: a failure's re-plan would only log why it cannot run
            self._servable()
            # a re-plan after the last replica died brings one back: its requests wait for it
            engine.hold_while_empty(time_limit_s + HOLD_MARGIN_S)
            self._thread = threading.Thread(target=self._watch, name="hetserve-replan", daemon=True)
            self._thread.start()

    def _servable(self):
        """(model spec, the workload's requests a re-plan plans for): those the engine serves, as
        `hetserve plan` plans; one beyond the context would size every layout's KV for tokens the
        engine refuses. SpecError where none fits."""
        from hetserve.planner.servable import servable
        from hetserve.runtime.deployment import model_spec
        from hetserve.specs.model import DTYPE_BYTES
        from hetserve.specs.workload import load_workload

        # named as the plan names the model (its checkpoint folder), not by its architecture
        spec = dataclasses.replace(model_spec(self.engine.arch, DTYPE_BYTES[self.engine.dtype]),
                                   name=self.engine.plan.model)
        return spec, servable(load_workload(self.workload), spec, self.workload, "re-planned")

    def replan(self, cluster: str | None = None, lost: list[str] | None = None,
               returned: list[str] | None = None, *, trigger: str = "request", attempt: int = 1) -> dict[str, Any]:
        """Re-plan now; returns the record (kept / retired / added replicas, seconds per part). Each
        one is counted by trigger and outcome (``counts``; /metrics' ``hetserve_replans_total``).
        ``attempt``: which try of a failure's re-plan this is (the watcher's retries). A device whose
        worker fails to start is lost afterwards (``WorkerStartFailure``), until returned."""
        try:
            record = self._replan(cluster, lost, returned, trigger, attempt)
        except BaseException:
            self.counts[trigger, "failed"] += 1
            raise
        self.counts[trigger, "done"] += 1
        return record

    def _replan(self, cluster: str | None, lost: list[str] | None, returned: list[str] | None,
                trigger: str, attempt: int) -> dict[str, Any]:
        from hetserve.planner.options import PlanOptions
        from hetserve.planner.replan import replan

        with self._lock:
            t0 = time.monotonic()
            self._note_deaths()
            eng = self.engine
            new_cluster = _requested_cluster(cluster) if cluster else eng.cluster
            # the request's view of the lost devices; kept only once a plan is made (a refused
            # re-plan must not leave its devices behind for the next one)
            was_lost = set(lost) if lost is not None else set(self.lost)
            back = set(returned or ())
            for param, named in (("lost", set(lost or ())), ("returned", back)):
                unknown = sorted(d for d in named if not new_cluster.has_device(d))
                if unknown:
                    raise ReplanInputError(f"re-plan: {param} devices {unknown} are not in cluster "
                                           f"{new_cluster.name!r}", param)
            gone = sorted(d for d in was_lost if not new_cluster.has_device(d))
            if gone and returned:  # devices lost earlier that the new cluster file no longer holds
                raise ReplanInputError(f"re-plan: lost devices {gone} are not in cluster {new_cluster.name!r}",
                                       "cluster")
            if lost is not None and was_lost & back:
                raise ReplanInputError(f"re-plan: devices {sorted(was_lost & back)} are named both lost and "
                                       "returned", "returned")
            if back - was_lost:  # returning what never left would re-plan for nothing
                raise ReplanInputError(f"re-plan: returned devices {sorted(back - was_lost)} are not lost (lost "
                                       f"now: {sorted(was_lost) or 'none'})", "returned")
            new_lost = was_lost - back
            running = eng.stats().get("replicas", {})
            # roles as they run now: a worker's death may have switched some from the plan's (a prefill
            # replica decoding in place), which the re-plan then keeps and reports as no change
            planned = {r.id: r.role for r in eng.plan.replicas}
            live = {rid: s["role"] for rid, s in running.items() if s.get("alive", True) and s.get("role")}
            spec, fit = self._servable()
            if fit.note:
                log.info("re-plan: %s", fit.note)
            for tries_left in range(PLAN_TRIES - 1, -1, -1):
                dead = {rid for rid, s in running.items() if not s.get("alive", True)}
                plan = replan(new_cluster, spec, fit.workload, eng.plan, new_lost,
                              algorithm=self.algorithm, dead_replicas=dead,
                              options=PlanOptions(seed=self.seed, time_limit_s=self.time_limit_s))
                # a worker that died while the planner ran: its replica is in the plan as kept, and the
                # engine (keeping only live replicas) would start a copy of it on the dead device; plan
                # again without it (the last try leaves a later death to the watcher's next re-plan)
                late = sorted(d["worker"] for d in self._note_deaths()) if tries_left else []
                if not late:
                    break
                log.warning("re-plan: worker(s) %s died while it planned; planning again without them", late)
                new_lost |= set(late)
                running = eng.stats().get("replicas", {})
            # a device counts as lost until the plan without it serves: returned devices stay lost while
            # their workers start (/health says degraded), and for good if they fail to
            self.lost = self.lost | new_lost
            t_planned = time.monotonic()
            try:
                record = eng.reconfigure(plan, new_cluster)
            except WorkerStartFailure as exc:  # planned onto again at once, it would fail the same way
                self.lost |= set(exc.workers)
                raise
            self.lost = new_lost
            record = {"trigger": trigger, "outcome": "done", **({"try": attempt} if attempt > 1 else {}),
                      "lost": sorted(self.lost), "plan_s": t_planned - t0, **record,
                      "role_changes": role_changes(planned, live, dict(record.get("roles") or {}), record["kept"]),
                      "total_s": time.monotonic() - t0}
            # one a failure forced is what an operator must see at the default log level; logged
            # before the record is published, so whoever sees it in ``history`` finds the line too
            log.log(logging.WARNING if trigger != "request" else logging.INFO,
                    "re-plan (%s; lost devices: %s): kept %s (roles changed in place since the last plan: %s), "
                    "retired %s, added %s; planning %.2f s, start-up %.2f s, total %.2f s",
                    trigger if attempt == 1 else f"{trigger}, try {attempt} of {RETRIES + 1}",
                    record["lost"] or "none", record["kept"],
                    ", ".join(f"{rid} {' -> '.join(chain)}" for rid, chain in record["role_changes"].items()) or "none",
                    record["retired"], _with_pids(record["added"], eng.plan, eng.worker_pids()),
                    record["plan_s"], record["start_s"], record["total_s"])
            self.history.append(record)
            return record

    def _note_deaths(self) -> list[dict[str, Any]]:
        deaths = list(self.engine.stats().get("deaths", []))
        new = deaths[self._seen_deaths:]
        self._seen_deaths = len(deaths)
        for d in new:
            self.lost.add(d["worker"])  # its device left; the replica's other devices are free
        return new

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            deaths = self.engine.stats().get("deaths", [])
            if len(deaths) <= self._seen_deaths or self.engine._closed:
                continue
            self._recover(deaths[self._seen_deaths])

    def _recover(self, first: dict[str, Any]) -> None:
        """The re-plan after death ``first``, tried again while its new workers fail to start (module
        docstring). Requests held for it (no replica left) wait through the retries, up to the hold's
        own limit, and fail once no try is left."""
        done_before, delay = self._served(), RETRY_FIRST_S
        for attempt in range(1, RETRIES + 2):
            trigger = "failure" if attempt == 1 else "retry"
            try:
                record = self.replan(trigger=trigger, attempt=attempt)
                record["failure_to_serving_s"] = time.monotonic() - first["at"]
                return
            except Exception as exc:  # noqa: BLE001 - the engine keeps serving on what it has
                why = _worded(exc)
                retry = isinstance(exc, WorkerStartFailure) and attempt <= RETRIES and not self._no_retries.is_set()
                failed = {"trigger": trigger, "outcome": "failed", "try": attempt,
                          "error": why, "lost": sorted(self.lost), "retry_in_s": delay if retry else None}
                if not retry:
                    # only a start-up failure is tried again: a plan refused, or a bug, would fail the same way
                    tries, tail = ((f" (try {attempt} of {RETRIES + 1})", "; not tried again: the devices it freed "
                                    "stay idle until an operator re-plans (POST /admin/replan)")
                                   if isinstance(exc, WorkerStartFailure) else ("", ""))
                    log.error("re-plan after %s failed%s: %s%s", first["why"], tries, why, tail,
                              exc_info=None if isinstance(exc, HetserveError) else exc)
                    self.history.append(failed)  # after its line: whoever sees it in ``history`` finds the line
                    self.engine.end_hold(f"the re-plan failed: {why}")  # nothing held unless no replica is left
                    return
                log.warning("re-plan after %s failed (try %d of %d): %s; device(s) %s counted lost, trying again "
                            "in %g s", first["why"], attempt, RETRIES + 1, why, ", ".join(exc.workers) or "none",
                            delay)
                self.history.append(failed)
            if self._no_retries.wait(delay):
                if not self._stop.is_set():  # closed: the engine is being shut down, and fails what it holds
                    log.warning("re-plan after %s: not tried again, the server is shutting down", first["why"])
                    self.engine.end_hold("the server is shutting down: no re-plan will bring a replica back")
                return
            if self._served() != done_before:  # one since the failure makes its retries moot
                log.info("re-plan after %s: not tried again, a re-plan since serves", first["why"])
                return
            delay = min(2 * delay, RETRY_MAX_S)

    def _served(self) -> int:
        """Re-plans that served so far, whatever their trigger."""
        return sum(n for (_, outcome), n in list(self.counts.items()) if outcome == "done")

    def stop_retries(self) -> None:
        """No failed re-plan is tried again from now on (the graceful shutdown: new workers would start
        only to be stopped); one waiting to be tried again stops waiting, and requests held for it fail."""
        self._no_retries.set()

    def close(self) -> None:
        self._stop.set()
        self._no_retries.set()


def _worded(exc: Exception) -> str:
    """Why a re-plan failed, for the log and the requests held for it. hetserve's own errors are worded
    for the operator; any other is a bug, named with its type (a KeyError's text alone is the bare key)."""
    why = str(exc) or repr(exc)  # an exception without a message still says what it was
    if not isinstance(exc, HetserveError) and str(exc):
        why = f"{type(exc).__name__}: {exc}"
    return why


def _with_pids(added: list[str], plan, pids: dict[str, int]) -> str:
    """The added replicas with their workers' devices and process ids (for an operator's ps / kill,
    as the start-up banner names the first ones). ``plan`` is the engine's plan after the re-plan:
    ``added`` holds the engine's ids, which differ from the planner's where it renamed a replica
    named like one retired earlier. A replica it lacks is named alone: the line reports a re-plan
    that has happened, and must never turn it into a failed one."""
    devices = {r.id: r.devices for r in plan.replicas}
    return ", ".join(f"{rid} ({', '.join(f'{d} pid {pids[d]}' for d in devices[rid] if d in pids)})"
                     if rid in devices else rid for rid in added) or "none"
