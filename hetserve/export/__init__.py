"""Launch bundles: a plan as the scripts, router configuration and ``deploy.json`` of an engine.

``export_bundle(plan, cluster, engine, out_dir, ...)`` refuses a plan the engine cannot run
(``rules.violations``: the replica and the rule), then writes the bundle (``bundle.Bundle``) the
engine's module builds: ``vllm``, ``sglang``, ``native`` (hetserve's own engine over Ray).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hetserve.export import native, sglang, vllm
from hetserve.export.bundle import Bundle
from hetserve.export.common import RAY_PORT, ExportContext
from hetserve.export.rules import refuse_unless_runnable

ENGINES = ("hetserve", "vllm", "sglang")


def build_bundle(plan, cluster, engine: str, model_path: str, num_layers: int,
                 cluster_ref: str = "cluster.yaml", ray_port: int = RAY_PORT) -> Bundle:
    """The bundle of ``plan`` for ``engine`` (refused with a ``PlanError`` if it cannot run it)."""
    refuse_unless_runnable(plan, engine)
    ctx = ExportContext(plan, cluster, model_path, num_layers, ray_port=ray_port)
    if engine == "vllm":
        b = vllm.build(ctx)
    elif engine == "sglang":
        b = sglang.build(ctx)
    else:
        b = native.build(ctx, cluster_ref)
    b.readme = readme(b, plan)
    b.check(plan)
    return b


def export_bundle(plan, cluster, engine: str, out_dir: str | Path, model_path: str, num_layers: int,
                  cluster_path: str | None = None, ray_port: int = RAY_PORT) -> list[Path]:
    """Write ``plan``'s bundle for ``engine`` into ``out_dir``; the cluster file is copied beside it
    (a hetserve bundle's ``hetserve serve`` reads it). Returns the paths written."""
    ref = "cluster.yaml" if cluster_path else cluster.name
    b = build_bundle(plan, cluster, engine, model_path, num_layers, cluster_ref=ref, ray_port=ray_port)
    written = b.write(out_dir, plan)
    if cluster_path:
        shutil.copyfile(cluster_path, Path(out_dir) / "cluster.yaml")
        written.append(Path(out_dir) / "cluster.yaml")
    return written


def readme(b: Bundle, plan) -> str:
    """The bundle's README: what runs where, and in which order to start it."""
    lines = [f"# {b.engine} launch bundle: {plan.model} on {plan.cluster}", "",
             f"Made by `hetserve export --to {b.engine}` from `plan.json` ({plan.algorithm}). "
             f"Engine version the flags follow: {b.engine_version}.", "",
             "| replica | role | devices | endpoint |", "|---|---|---|---|"]
    for r in b.replicas:
        lines.append(f"| {r.id} | {r.role} | {' '.join(r.devices)} | {r.endpoint} |")
    lines += ["", "## Start, in this order", "",
              "1. Put the same engine version and the model at the same path on every machine"
              + (" (`pip install 'hetserve[runtime,ray]'`; one Ray token on every machine, mode 600: "
                 "`ray get-auth-token --generate`, docs/multinode.md; the scripts set `RAY_AUTH_MODE=token` "
                 "unless the environment already sets it)" if b.engine == "hetserve" else "")
              + ".",
              "2. On every machine, its Ray nodes (skip where a script has none): "
              + ", ".join(f"`bash machines/{m}.sh ray` on {m}" for m in b.machines) + ".",
              "3. On every machine, its servers: "
              + ", ".join(f"`bash machines/{m}.sh serve` on {m}" for m in b.machines)
              + ". A server prints when it is ready; a script ends all its servers when one exits.",
              f"4. The router on the first machine: `{' '.join(b.router['argv'])}` (router.json); clients "
              f"use {b.router.get('endpoint', 'its address')}.", "",
              "Stop with Ctrl-C in each script, then `ray stop` where a Ray node was started.", "",
              "`deploy.json` lists every process: its machine, GPU indices, argv and environment."]
    if b.engine == "vllm" and any("ray_address" in r.extra for r in b.replicas):
        lines += ["", "A replica over several machines runs on a Ray cluster of its own (its `ray_address`): "
                  "vLLM's Ray executor puts the head machine's GPUs first, as the plan's first stages."]
    if b.router.get("note"):
        lines += ["", f"Router: {b.router['note']}."]
    return "\n".join(lines) + "\n"
