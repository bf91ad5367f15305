"""The deployment ``Plan``: replicas (role + pipeline stages), KV routes, and the planner's estimates.

File format (JSON; YAML accepted) is the contract in DESIGN.md:

    {"model": ..., "cluster": ..., "algorithm": ...,
     "replicas": [{"id": "p0", "role": "prefill",
                   "stages": [{"devices": ["a0:0", "a0:1"], "layers": [0, 80]}]}, ...],
     "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}],
     "estimate": {"throughput_tokens_per_s": ..., "cost_usd_per_hour": ...}}

Devices are named here (``machine:index``), not indexed, so a plan file reads on its own;
``Plan.replica_layout(replica, cluster)`` turns names into the indices the cost model uses.
Structural checks live in ``validate_plan`` (hetserve.planner.validate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.errors import PlanError, SpecError
from hetserve.specs._validation import read_mapping, validate
from hetserve.specs.cluster import Cluster

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")


def serves_prefill(role: str) -> bool:
    """A replica of this role runs prompts (prefill or colocated)."""
    return role in ("prefill", "colocated")


def serves_decode(role: str) -> bool:
    """A replica of this role generates tokens (decode or colocated)."""
    return role in ("decode", "colocated")


class HasRole:
    """``serves_prefill`` / ``serves_decode`` for anything with a ``role`` (plan replicas, the
    runtime's replica specs and schedulers)."""

    role: str

    @property
    def serves_prefill(self) -> bool:
        return serves_prefill(self.role)

    @property
    def serves_decode(self) -> bool:
        return serves_decode(self.role)


@dataclass(frozen=True)
class PlanStage:
    devices: tuple[str, ...]
    layers: tuple[int, int]  # half-open

    @property
    def tp(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class PlanReplica(HasRole):
    id: str
    role: Role
    stages: tuple[PlanStage, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    def layout(self, cluster: Cluster) -> ReplicaLayout:
        """This replica as device indices of ``cluster`` (the cost model's view)."""
        return ReplicaLayout(tuple(
            StageLayout(tuple(cluster.device(d).index for d in s.devices), s.layers) for s in self.stages))

    @staticmethod
    def from_layout(rid: str, role: Role, layout: ReplicaLayout, cluster: Cluster) -> "PlanReplica":
        return PlanReplica(rid, role, tuple(
            PlanStage(tuple(cluster.devices[i].name for i in s.devices), s.layers) for s in layout.stages))


@dataclass(frozen=True)
class KVRoute:
    src: str  # prefill replica id ("from" in the file)
    dst: str  # decode replica id ("to")
    weight: float


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    algorithm: str
    replicas: tuple[PlanReplica, ...]
    kv_routes: tuple[KVRoute, ...] = ()
    estimate: dict[str, Any] = field(default_factory=dict)
    # How the search got here (best value over time, gains per kind of edit): kept out of the plan
    # file so it stays readable; ``hetserve plan --history FILE`` writes it on its own.
    search_log: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    # ---------------------------------------------------------------- queries
    def replica(self, rid: str) -> PlanReplica:
        for r in self.replicas:
            if r.id == rid:
                return r
        raise KeyError(rid)

    def by_role(self, role: str) -> tuple[PlanReplica, ...]:
        return tuple(r for r in self.replicas if r.role == role)

    @property
    def is_disaggregated(self) -> bool:
        return any(r.role == "prefill" for r in self.replicas)

    def routes_from(self, rid: str) -> tuple[KVRoute, ...]:
        return tuple(k for k in self.kv_routes if k.src == rid)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for r in self.replicas for d in r.devices)

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "cluster": self.cluster,
            "algorithm": self.algorithm,
            "replicas": [{"id": r.id, "role": r.role,
                          "stages": [{"devices": list(s.devices), "layers": list(s.layers)} for s in r.stages]}
                         for r in self.replicas],
            "kv_routes": [{"from": k.src, "to": k.dst, "weight": k.weight} for k in self.kv_routes],
            "estimate": self.estimate,
        }

    @staticmethod
    def from_dict(data: dict[str, Any], source: str = "<plan>") -> "Plan":
        f = validate(_PlanFile, data, source)
        return Plan(
            model=f.model, cluster=f.cluster, algorithm=f.algorithm,
            replicas=tuple(PlanReplica(r.id, r.role, tuple(PlanStage(tuple(s.devices), (s.layers[0], s.layers[1]))
                                                           for s in r.stages)) for r in f.replicas),
            kv_routes=tuple(KVRoute(k.from_, k.to, k.weight) for k in f.kv_routes),
            estimate=dict(f.estimate),
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise SpecError(str(path), "(file)", "an existing plan file")
        try:
            return Plan.from_dict(read_mapping(path), str(path))
        except SpecError as exc:
            raise PlanError(str(exc)) from exc


# ----------------------------------------------------------------------------- file schema


class _Stage(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    devices: list[str] = pydantic.Field(min_length=1)
    layers: tuple[int, int]


class _Replica(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    id: str = pydantic.Field(min_length=1)
    role: Role
    stages: list[_Stage] = pydantic.Field(min_length=1)


class _Route(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = pydantic.Field(alias="from")
    to: str
    weight: float = pydantic.Field(ge=0)


class _PlanFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    model: str
    cluster: str
    algorithm: str = "manual"
    replicas: list[_Replica] = pydantic.Field(min_length=1)
    kv_routes: list[_Route] = []
    estimate: dict[str, Any] = {}


