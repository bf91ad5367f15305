"""Grouped scheduling (Aladdin Appendix A): arrivals are dealt round robin to groups of workers,
each with its own scheduler that sees only its own workers.

At a high arrival rate one central best-fit scheduler takes too long per decision; with
``N_group`` groups each scheduler sees 1/N_group of the arrivals and of the workers. The price is
utilisation: a group cannot lend its spare room to another (Appendix A sizes each group at ≥ 1/(2e)
workers to keep the extra workers needed under e). Works with any placement policy per group.
"""

from __future__ import annotations

from typing import Callable, Sequence

from hetserve.policies.base import ReplicaState, RequestInfo


def split_groups(ids: Sequence[str], groups: int) -> list[list[str]]:
    """``ids`` dealt into ``groups`` contiguous groups whose sizes differ by at most one."""
    if groups < 1 or groups > len(ids):
        raise ValueError(f"groups must be in [1, {len(ids)}], got {groups}")
    size, extra = divmod(len(ids), groups)
    out, k = [], 0
    for g in range(groups):
        n = size + (1 if g < extra else 0)
        out.append(list(ids[k:k + n]))
        k += n
    return out


class GroupedPlacement:
    """Round-robin of arrivals over groups; inside a group, the group's own policy decides.

    ``groups``: the worker ids of each group; ``make_policy(ids)``: a fresh policy for one group
    (each keeps its own state: predictions, re-balancing ledger). O(1) plus the group policy's cost
    over its own workers.
    """

    name = "grouped"

    def __init__(self, groups: Sequence[Sequence[str]], make_policy: Callable[[list[str]], object]):
        if not groups or any(not g for g in groups):
            raise ValueError("every group needs at least one worker")
        self.groups = [list(g) for g in groups]
        self.policies = [make_policy(g) for g in self.groups]
        self._member = [set(g) for g in self.groups]
        self.needs_requests = any(getattr(p, "needs_requests", False) for p in self.policies)
        self._next = 0
        self._owner: dict[int, int] = {}  # request id -> group that placed it

    @property
    def stats(self) -> dict:
        out: dict = {}
        for p in self.policies:
            for k, v in getattr(p, "stats", {}).items():
                out[k] = out.get(k, 0) + v
        return out

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str:
        g = self._next
        self._next = (g + 1) % len(self.groups)
        mine = [r for r in candidates if r.id in self._member[g]]
        if not mine:  # the group's workers are not offered (e.g. all down): any candidate will do
            mine = list(candidates)
        self._owner[request.id] = g
        return self.policies[g].choose(request, mine, now)

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        g = self._owner.pop(request_id, None)
        if g is not None:
            on_finish = getattr(self.policies[g], "on_finish", None)
            if on_finish is not None:
                on_finish(request_id, input_tokens, output_tokens)
