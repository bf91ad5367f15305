"""The deployment ``Plan``: replicas (role + pipeline stages), KV routes, and the planner's estimates.

File format (JSON; YAML accepted) is the contract in docs/design.md:

    {"model": ..., "cluster": ..., "algorithm": ...,
     "replicas": [{"id": "p0", "role": "prefill",
                   "stages": [{"devices": ["a0:0", "a0:1"], "layers": [0, 80]}]}, ...],
     "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}],
     "estimate": {"throughput_tokens_per_s": ..., "cost_usd_per_hour": ...},
     "cluster_file": {"path": "pools/two-sites.yaml", "sha256": "..."}}   # optional

``cluster_file`` (optional, added to the docs/design.md contract) records the cluster file a plan was
made on, when it was made from a file rather than a preset: its path, relative to the plan file's
folder (so the two can move together), and the SHA-256 of its bytes, so a later reader finds the
file without ``--cluster`` and notices when it has changed (docs/planner.md).

Devices are named here (``machine:index``), not indexed, so a plan file reads on its own;
``Plan.replica_layout(replica, cluster)`` turns names into the indices the cost model uses.
Structural checks live in ``validate_plan`` (hetserve.planner.validate).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import pydantic

from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.errors import PlanError, SpecError
from hetserve.specs._validation import read_mapping, refuse_other_kind, validate
from hetserve.specs.cluster import Cluster

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")


def serves_prefill(role: str) -> bool:
    """A replica of this role runs prompts (prefill or colocated)."""
    return role in ("prefill", "colocated")


def serves_decode(role: str) -> bool:
    """A replica of this role generates tokens (decode or colocated)."""
    return role in ("decode", "colocated")


def unused_id(rid: str, used: set[str]) -> str:
    """``rid``, else ``rid.1``, ``rid.2``, ...: the first not in ``used``, which it joins. A new
    replica never takes a running (or earlier) replica's id, so ids name one replica for good."""
    new, n = rid, 1
    while new in used:
        new, n = f"{rid}.{n}", n + 1
    used.add(new)
    return new


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

    def stages_digest(self) -> str:
        """A short SHA-256 of the stages as the plan file writes them (devices and layers, in order):
        the estimate keeps it, so a later edit of a replica's devices shows (``describe plan``)."""
        stages = [[list(s.devices), list(s.layers)] for s in self.stages]
        return hashlib.sha256(json.dumps(stages).encode()).hexdigest()[:16]

    @staticmethod
    def from_layout(rid: str, role: Role, layout: ReplicaLayout, cluster: Cluster) -> "PlanReplica":
        return PlanReplica(rid, role, tuple(
            PlanStage(tuple(cluster.devices[i].name for i in s.devices), s.layers) for s in layout.stages))


@dataclass(frozen=True)
class KVRoute:
    src: str  # prefill replica id ("from" in the file)
    dst: str  # decode replica id ("to")
    weight: float


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class ClusterFile:
    """The cluster file a plan was made on: its path (absolute once loaded) and the SHA-256 of its
    bytes when the plan was made."""

    path: Path
    sha256: str

    @staticmethod
    def of(path: str | Path) -> "ClusterFile":
        """The file at ``path`` as it is now."""
        return ClusterFile(Path(os.path.abspath(path)), file_sha256(path))

    @property
    def shown(self) -> str:
        """The path as the user would type it: relative to the working directory when below it."""
        try:
            rel = os.path.relpath(self.path)
        except ValueError:  # another drive
            return str(self.path)
        return str(self.path) if rel.startswith("..") else rel

    def current_sha256(self) -> str | None:
        """The file's SHA-256 now (None: it is missing or unreadable)."""
        try:
            return file_sha256(self.path)
        except OSError:
            return None

    def to_dict(self, base: Path | None = None) -> dict[str, str]:
        """``path`` relative to ``base`` (the plan file's folder) where it can be, else absolute."""
        path = str(self.path)
        if base is not None:
            try:
                path = os.path.relpath(self.path, os.path.abspath(base))
            except ValueError:  # another drive: only the absolute path reaches it
                pass
        return {"path": Path(path).as_posix(), "sha256": self.sha256}


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
    # The cluster file the plan was made on (None: made on a preset, or the file was not recorded).
    # Where the plan came from, not what it is: left out of equality.
    cluster_file: ClusterFile | None = field(default=None, compare=False)

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
    def to_dict(self, base: str | Path | None = None) -> dict[str, Any]:
        """The plan file's mapping; ``base``: the folder the file is written to (``cluster_file``'s
        path is written relative to it)."""
        data = {
            "model": self.model,
            "cluster": self.cluster,
            "algorithm": self.algorithm,
            "replicas": [{"id": r.id, "role": r.role,
                          "stages": [{"devices": list(s.devices), "layers": list(s.layers)} for s in r.stages]}
                         for r in self.replicas],
            "kv_routes": [{"from": k.src, "to": k.dst, "weight": k.weight} for k in self.kv_routes],
            "estimate": self.estimate,
        }
        if self.cluster_file is not None:
            data["cluster_file"] = self.cluster_file.to_dict(Path(base) if base is not None else None)
        return data

    @staticmethod
    def from_dict(data: dict[str, Any], source: str = "<plan>", base: str | Path | None = None) -> "Plan":
        """A plan from its file's mapping; ``base``: the plan file's folder, against which a relative
        ``cluster_file`` path is resolved (default: the working directory)."""
        refuse_other_kind(data, source, "replicas", "a plan file (hetserve plan -o FILE: model, cluster, replicas)")
        f = validate(_PlanFile, data, source)
        cf = None
        if f.cluster_file is not None:
            p = Path(f.cluster_file.path)
            cf = ClusterFile(Path(os.path.abspath(p if p.is_absolute() or base is None else Path(base) / p)),
                             f.cluster_file.sha256)
        return Plan(
            model=f.model, cluster=f.cluster, algorithm=f.algorithm,
            replicas=tuple(PlanReplica(r.id, r.role, tuple(PlanStage(tuple(s.devices), (s.layers[0], s.layers[1]))
                                                           for s in r.stages)) for r in f.replicas),
            kv_routes=tuple(KVRoute(k.from_, k.to, k.weight) for k in f.kv_routes),
            estimate=f.estimate.model_dump(exclude_unset=True),
            cluster_file=cf,
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml
            path.write_text(yaml.safe_dump(self.to_dict(path.parent), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(path.parent), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Plan":
        path = Path(path)
        if not path.exists():
            raise SpecError(str(path), "(file)", "an existing plan file")
        try:
            return Plan.from_dict(read_mapping(path), str(path), path.parent)
        except SpecError as exc:
            raise PlanError(str(exc)) from exc


def load_plan_cluster(plan: Plan, source: str = "<plan>", cluster: str | Path | None = None,
                      warn: Callable[[str], None] | None = None) -> Cluster:
    """The cluster to run ``plan`` on: ``cluster`` (a preset or file the user named) when given, else
    the cluster file the plan records (``warn`` is told, naming the file, when its bytes changed since
    the plan was made), else the file (``named_cluster_file``) or preset the plan's ``cluster``
    names. A recorded file that is missing, or a name that is neither, is a ``SpecError`` naming
    ``source`` (the plan file) and saying which file to pass. ``warn`` defaults to ``warnings.warn``."""
    from hetserve.specs.cluster import cluster_presets, load_cluster

    if cluster is not None:
        return load_cluster(cluster)
    cf = plan.cluster_file
    if cf is not None:
        now = cf.current_sha256()
        shown = cf.shown
        if now is None:
            raise SpecError(source, "cluster_file.path",
                            f"the cluster file the plan was made on (cluster {plan.cluster!r}); restore it, or "
                            f"pass --cluster with that pool's file", f"{shown} (no such file)")
        if now != cf.sha256:
            (warn or _warn)(f"{shown}, the cluster file {source} was made on, has changed since (SHA-256 "
                            f"{cf.sha256[:12]}… then, {now[:12]}… now): the plan runs on it as it is now")
        return load_cluster(cf.path)
    named = named_cluster_file(plan, source)
    try:
        return load_cluster(plan.cluster if named is None else named)
    except SpecError as exc:
        if exc.field != "(cluster)":  # found, but malformed: that error says more
            raise
        places = plan_places(plan.cluster, source)
        looked = (f" (looked for in the working directory, {os.getcwd()}, and beside the plan, at {places[1]})"
                  if len(places) == 2 else f" (looked for at {places[0]})" if places else "")
        raise SpecError(source, "cluster", f"a cluster preset ({', '.join(cluster_presets())}) or a cluster "
                        f"file{looked}; the plan records no cluster file, so pass --cluster with the file it was "
                        "made on", plan.cluster) from exc


def named_cluster_file(plan: Plan, source: str) -> Path | None:
    """The cluster file the plan's ``cluster`` field names, where one is (None: a preset's name, or
    no such file), looked for where ``plan_places`` says."""
    return next((p for p in plan_places(plan.cluster, source) if p.is_file()), None)


def plan_places(name: str, source: str) -> list[Path]:
    """Where a file or folder a plan names by path (its ``cluster``, its ``model``) is looked for:
    from the working directory first, as it always was, so a plan that worked from here still
    does; then beside the plan file ``source``, so a plan moved with its pool or checkpoint still
    finds them. Once where the two are one folder; none for a blank name (``existing_path``)."""
    if not name.strip():
        return []
    path = Path(name)
    places = [path] if path.is_absolute() else [path, Path(source).parent / path]
    return [p for i, p in enumerate(places) if os.path.abspath(p) not in map(os.path.abspath, places[:i])]


def _warn(message: str) -> None:
    import warnings
    warnings.warn(message, stacklevel=3)


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

    @pydantic.model_validator(mode="after")
    def _layers_half_open(self) -> "_Replica":
        for i, st in enumerate(self.stages):
            if not 0 <= st.layers[0] < st.layers[1]:
                raise ValueError(f"replica {self.id!r} stage {i}: layers [first, last) with 0 <= first < last, "
                                 f"got {list(st.layers)}")
        return self


class _Route(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = pydantic.Field(alias="from")
    to: str
    weight: float = pydantic.Field(ge=0, allow_inf_nan=False)


class _ClusterFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    path: str = pydantic.Field(min_length=1)
    sha256: str = pydantic.Field(pattern=r"^[0-9a-f]{64}$")


_Figure = Annotated[float | None, pydantic.Field(ge=0, allow_inf_nan=False)]
_Count = Annotated[int | None, pydantic.Field(ge=0)]


class _Estimate(pydantic.BaseModel):
    """The planner's figures: the ones other commands print must be non-negative numbers; anything
    else the planner adds (per-replica and per-link detail) is kept as written."""
    model_config = pydantic.ConfigDict(extra="allow")
    throughput_tokens_per_s: _Figure = None
    cost_usd_per_hour: _Figure = None
    tokens_per_usd: _Figure = None
    requests_per_period: _Figure = None
    period_s: _Figure = None
    mean_input_tokens: _Figure = None
    mean_output_tokens: _Figure = None
    upper_bound_tokens_per_s: _Figure = None
    upper_bound_wall_s: _Figure = None
    devices_used: _Count = None
    devices_total: _Count = None


class _PlanFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    model: str
    cluster: str
    algorithm: str = "manual"
    replicas: list[_Replica] = pydantic.Field(min_length=1)
    kv_routes: list[_Route] = []
    estimate: _Estimate = _Estimate()
    cluster_file: _ClusterFile | None = None


