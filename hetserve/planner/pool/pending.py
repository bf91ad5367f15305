"""A pool layout part-way through being scored: what ``Evaluator.score`` and ``BoundedChoice`` share."""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.cost.layout import ReplicaLayout
from hetserve.planner.pool.flow import FlowNetwork
from hetserve.planner.pool.groups import Group


@dataclass
class Pending:
    """A pool layout part-way through ``Evaluator.score``: its groups' layouts (``choice``: index
    into each group's options) and capacities, its flow network (KV edges and loads filled in
    once ``built``) and the best bound (tokens/s) known on its score."""

    key: tuple[Group, ...]
    layouts: list[ReplicaLayout | None]
    caps: list[float]
    net: FlowNetwork
    colocated: float  # requests per T the colocated groups serve
    bound: float
    choice: tuple[int, ...]
    built: bool = False
    tightened: bool = False  # ``bound`` is the duality bound where one applies
