"""The requests a plan (or a worker count) is made for: those a server of the model takes.

A request whose prompt plus output exceeds the model's context is refused by the engine and by the
simulator, so a plan counting it would promise tokens nobody serves; and its KV cache, priced into
the mean lengths every layout is sized on, can make a pool look unable to hold any replica. Every
plan — ``hetserve plan``, the serving engine's re-plan, ``hetserve capacity``'s sizing — is made for
``servable(...)``'s workload, so they agree on what a pool can hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.errors import SpecError


@dataclass(frozen=True)
class Servable:
    """``workload``: the requests within the model's context; ``dropped``: how many were left out
    of ``total``; ``note``: one line saying so (None when none were)."""

    workload: object
    dropped: int
    total: int
    note: str | None


def servable(workload, model, source: str, purpose: str = "planned") -> Servable:
    """The requests of ``workload`` within ``model``'s context. ``source``: the workload's name as the
    user gave it (errors name it); ``purpose``: what the note says was done for the rest ("planned",
    "sized"). SpecError when the workload is empty or no request fits."""
    if not len(workload):
        raise SpecError(source, "(requests)", "at least one request", "none")
    fits = workload.within_context(model.max_context)
    if not len(fits):
        raise SpecError(source, "(requests)", f"requests within {model.name}'s context of "
                        f"{model.max_context} tokens", f"all {len(workload)} longer")
    dropped = len(workload) - len(fits)
    note = (f"{dropped} of {len(workload)} requests exceed {model.name}'s context of {model.max_context} tokens; "
            f"{purpose} for the {len(fits)} that fit") if dropped else None
    return Servable(fits, dropped, len(workload), note)
