"""Options that cannot act on the trace or plan they are given: an error (or a note) that says why.

* Link scheduling (``transmission``) orders the messages that cross the links. Under the aggregate
  pipeline model only KV hand-offs cross them (a pipeline's stage-to-stage activations are priced
  inside its step time, not sent); ``link_traffic`` says what the links carry for a plan, so the
  CLI can say when the chosen scheduling has nothing, or only part of the traffic, to act on.
"""

from __future__ import annotations

from hetserve.planner.plan import Plan
from hetserve.specs.workload import Workload

# what the stage-by-stage pipeline (``pipeline="detailed"``, ``sim/pipeline.py``) does not model
PAGED_IS_AGGREGATE = "paged KV admission is modelled on aggregate pipelines only"
DETAILED_PRICES_NEITHER = "the stage-by-stage pipeline simulates neither n > 1 choices nor prompt logprobs"


def detailed_unpriced(workload: Workload) -> tuple[int, int]:
    """(requests with n > 1 choices, requests scoring their prompt) of ``workload``: what the
    stage-by-stage pipeline decodes as one row and prices nothing for; either refuses it."""
    return int((workload.choices > 1).sum()), int(workload.prompt_logprobs.sum())


def pipelined_replicas(plan: Plan) -> list[str]:
    """Decode and colocated replicas of more than one stage: those ``pipeline="detailed"`` simulates
    stage by stage, their activations on the links (prefill replicas stay aggregate in both modes)."""
    return [r.id for r in plan.replicas if r.role != "prefill" and len(r.stages) > 1]


def link_traffic(plan: Plan, pipeline: str) -> set[str]:
    """The traffic kinds (``kv``, ``prefill``, ``decode``) that cross the links when ``plan`` is
    simulated with ``pipeline`` (``"aggregate"`` or ``"detailed"``): what link scheduling acts on."""
    kinds = {"kv"} if any(r.role == "prefill" for r in plan.replicas) else set()
    if pipeline == "detailed" and pipelined_replicas(plan):
        kinds |= {"prefill", "decode"}
    return kinds


def transmission_note(plan: Plan, plan_source: str, transmission: str, pipeline: str) -> tuple[str, str] | None:
    """What ``--transmission`` cannot act on for this plan and pipeline model: ``("error", text)``
    when nothing crosses the links, ``("warning", text)`` when only the KV hand-offs do while
    pipelined replicas' activations stay off them; None when it acts on all the link traffic."""
    kinds = link_traffic(plan, pipeline)
    piped = pipelined_replicas(plan)
    names = ", ".join(piped[:4]) + (" …" if len(piped) > 4 else "")
    opt = f"--transmission {transmission}"
    if not kinds:
        if piped and pipeline == "aggregate":
            return ("error", f"{opt} has nothing to schedule under --pipeline aggregate: {plan_source} has no KV "
                             f"hand-offs, and its pipelines' activations ({names}) are priced inside their steps, "
                             f"not sent over the links; pass --pipeline detailed to put them on the links, or drop "
                             f"--transmission")
        return ("error", f"{opt} has nothing to schedule: {plan_source} has no KV hand-offs and no replica of "
                         f"several stages, so no message crosses a link; drop --transmission")
    if transmission == "molink" and "decode" not in kinds:
        # MoLink's rule is decode activations first, bulk traffic in chunks fitted between them
        return ("warning", f"{opt} sends decode activations ahead of bulk traffic: only KV hand-offs cross "
                           f"{plan_source}'s links here, which it sends one after another as serial does"
                           + (" (--pipeline detailed puts the pipelines' activations on the links)" if piped else ""))
    if piped and pipeline == "aggregate":
        return ("warning", f"{opt} schedules only the KV hand-offs under --pipeline aggregate; the activations of "
                           f"{plan_source}'s pipelined replicas ({names}) are priced inside their steps, not sent "
                           f"over the links: pass --pipeline detailed to schedule them too")
    return None


def idle_plan_option(plan: Plan, plan_source: str, *, route: str | None = None,
                     colocated_only: list[str] = ()) -> str | None:
    """Why an option the user named cannot act on ``plan`` (None: every one can). ``route``: an
    explicit KV route policy, which has nothing to choose without a prefill replica; ``colocated_only``:
    the named options that shape only colocated replicas' steps (chunked prefill, prefill mode), which
    a plan of prefill and decode replicas alone never takes."""
    if route is not None and not any(r.role == "prefill" for r in plan.replicas):
        return (f"--route {route} chooses where prefilled KV goes: {plan_source} has no prefill replica, so no "
                f"KV hand-off is routed; drop --route")
    if colocated_only and not any(r.role == "colocated" for r in plan.replicas):
        return (f"{' / '.join(colocated_only)} shapes the steps of colocated replicas: {plan_source} has only "
                f"prefill and decode replicas; drop {' / '.join(colocated_only)}")
    return None
