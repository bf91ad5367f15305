"""The lower bound on a snapshot's outstanding tokens (``ReplicaState.outstanding_at_least``) as a
free function: placement policies ask it of every tied candidate at every decision, and in the
compiled build (``make fast-sim``) a call from a compiled policy into it costs no interpreter frame."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.policies.base import ReplicaState


def outstanding_at_least(state: ReplicaState, now: float) -> float:
    """A lower bound on ``state.outstanding_tokens`` at ``now`` (the snapshot's clock; inf: any
    moment) from its ``outstanding_floor`` and ``outstanding_drain``, without working it out."""
    floor: float = state.outstanding_floor
    drain = state.outstanding_drain
    if drain is None:
        return floor
    drained: float = drain[1] - drain[2] * (now - drain[0])  # nan (0·inf) at now = inf and no rate
    return drained if drained > floor else floor
