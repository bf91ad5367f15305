"""What each engine can run, checked on a whole plan before a bundle is written.

Each rule was read from the engine's source at the commit named in ``SOURCES`` (the versions a
bundle's ``deploy.json`` names as ``engine_version``):

vLLM
  * one ``--tensor-parallel-size`` and one ``--pipeline-parallel-size`` per server
    (``vllm/config/parallel.py``: world size = TP × PP, every stage the same TP);
  * layers per stage may differ: ``VLLM_PP_LAYER_PARTITION`` = one count per stage, as many as
    PP, summing to the model's layers (``vllm/distributed/utils.py``, ``get_pp_indices``);
  * P/D through the NIXL KV connector: the larger TP of a prefill → decode pair is a multiple of the
    smaller (``nixl_connector.py``: ``tp_ratio = divide(...)``), and the decode replica is
    unpipelined (its workers are paired with the prefill's by TP rank only);
  * a replica on several machines runs on one Ray cluster whose head is the machine of its first
    stage; each machine holds consecutive stages (the Ray executor orders ranks driver node first).
SGLang
  * one ``--tp-size`` per server; ``SGLANG_PP_LAYER_PARTITION`` for uneven stages
    (``python/sglang/srt/distributed/utils.py``, the same rule as vLLM's);
  * over ``--nnodes`` n machines each node runs ``pp_size // n`` consecutive pipeline ranks with the
    whole TP group (``entrypoints/engine.py``, the rank ranges of ``_launch_subprocesses``): the
    stage count is a multiple of the machine count, each machine holds the same number of
    consecutive stages, and a node's GPU for (pp_rank, tp_rank) is
    ``base_gpu_id + (pp_rank % pp_per_node) * tp + tp_rank``.
hetserve
  * every plan that ``validate_plan`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.errors import PlanError
from hetserve.specs.cluster import machine_of

# where the rules above were read: engine → (release they follow, repository@commit of the files read)
SOURCES = {
    "vllm": ("0.32.0", "vllm-project/vllm: vllm/config/parallel.py@840e7972c6ab, "
                       "vllm/distributed/utils.py@5a6541db9bfa, "
                       "vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py@0f1207513440"),
    "sglang": ("0.5.3", "sgl-project/sglang: python/sglang/version.py@0175ceecc135 (0.5.3rc2), "
                        "python/sglang/srt/server_args.py@469c63e54e7d, "
                        "python/sglang/srt/entrypoints/engine.py@18bfdd16794a"),
}


def engine_version(engine: str) -> str:
    """The version string a bundle records: the hetserve package's, or the engine release whose
    flags and rules it follows, with the source files read."""
    if engine == "hetserve":
        from hetserve import __version__
        return __version__
    release, files = SOURCES[engine]
    return f"{release} ({files})"


@dataclass(frozen=True)
class Violation:
    replica: str
    rule: str

    def __str__(self) -> str:
        return f"replica {self.replica}: {self.rule}"


def machine_runs(replica) -> list[tuple[str, list]]:
    """The replica's stages grouped into runs of consecutive stages on one machine, in order:
    [(machine, [stage, ...]), ...]; a machine may appear twice when its stages are not consecutive."""
    runs: list[tuple[str, list]] = []
    for s in replica.stages:
        machines = {machine_of(d) for d in s.devices}
        m = machine_of(s.devices[0]) if len(machines) == 1 else "+".join(sorted(machines))
        if runs and runs[-1][0] == m:
            runs[-1][1].append(s)
        else:
            runs.append((m, [s]))
    return runs


def violations(plan, engine: str) -> list[Violation]:
    """Every rule of ``engine`` (module docstring) that ``plan`` breaks; [] when it can run it."""
    if engine == "hetserve":
        return []
    if engine not in SOURCES:
        raise PlanError(f"--to: expected one of hetserve, vllm, sglang, got {engine!r}")
    out: list[Violation] = []
    flag = "--tensor-parallel-size" if engine == "vllm" else "--tp-size"
    for r in plan.replicas:
        tps = [s.tp for s in r.stages]
        if len(set(tps)) > 1:
            out.append(Violation(r.id, f"{engine} runs one TP degree per replica ({flag}), this one has "
                                       f"stages of TP {', '.join(map(str, tps))}"))
        runs = machine_runs(r)
        names = [m for m, _ in runs]
        if any("+" in m for m in names):
            out.append(Violation(r.id, f"{engine}: a stage spans machines ({', '.join(n for n in names if '+' in n)})"))
        if len(set(names)) != len(names):
            out.append(Violation(r.id, f"{engine}: each machine must hold consecutive stages; machine order "
                                       f"{' → '.join(names)}"))
        if engine == "sglang" and len(runs) > 1:
            per = {len(stages) for _, stages in runs}
            if len(per) > 1 or len(r.stages) % len(runs):
                out.append(Violation(r.id, "sglang over --nnodes machines runs pp_size // nnodes consecutive "
                                           "stages on each machine; this replica has "
                                           + ", ".join(f"{len(st)} on {m}" for m, st in runs)))
    if engine == "vllm":
        by_id = {r.id: r for r in plan.replicas}
        for k in plan.kv_routes:
            p, d = by_id[k.src], by_id[k.dst]
            tp_p, tp_d = p.stages[0].tp, d.stages[0].tp
            if max(tp_p, tp_d) % min(tp_p, tp_d):
                out.append(Violation(d.id, f"vllm's NIXL KV connector needs one TP degree of a KV pair to divide "
                                           f"the other; {p.id} has TP {tp_p}, {d.id} TP {tp_d}"))
        for d in plan.replicas:
            if d.role == "decode" and len(d.stages) > 1:
                out.append(Violation(d.id, "vllm's NIXL KV connector feeds an unpipelined decode replica "
                                           f"(--pipeline-parallel-size 1); this one has {len(d.stages)} stages"))
    return out


def refuse_unless_runnable(plan, engine: str) -> None:
    """Raise ``PlanError`` naming every replica and rule ``engine`` cannot run."""
    bad = violations(plan, engine)
    if bad:
        raise PlanError(f"{engine} cannot run this plan: " + "; ".join(map(str, bad))
                        + f" (re-plan with `hetserve plan --engine {engine}`)")
