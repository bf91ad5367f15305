"""Launch bundles: a plan as the scripts, router configuration and ``deploy.json`` of an engine.

``export_bundle(plan, cluster, engine, out_dir, ...)`` refuses a plan the engine cannot run
(``rules.violations``: the replica and the rule), then writes the bundle (``bundle.Bundle``) the
engine's module builds: ``vllm``, ``sglang``, ``native`` (hetserve's own engine over Ray).
"""

from __future__ import annotations

from pathlib import Path

from hetserve.export import native, sglang, vllm
from hetserve.export.bundle import Bundle
from hetserve.export.common import RAY_PORT, ExportContext, address_note, checkpoint_note
from hetserve.export.folder import MANIFEST, check_bundle_folder, manifest, remove_bundle
from hetserve.export.rules import refuse_unless_runnable

ENGINES = ("hetserve", "vllm", "sglang")


def build_bundle(plan, cluster, engine: str, model_path: str, num_layers: int,
                 cluster_ref: str = "cluster.yaml", ray_port: int = RAY_PORT, port_range=None) -> Bundle:
    """The bundle of ``plan`` for ``engine`` (refused with a ``PlanError`` if it cannot run it);
    ``port_range``: the hetserve bundle's ``hetserve serve --port-range`` (``ExportContext``)."""
    refuse_unless_runnable(plan, engine)
    ctx = ExportContext(plan, cluster, model_path, num_layers, ray_port=ray_port, port_range=port_range)
    if engine == "vllm":
        b = vllm.build(ctx)
    elif engine == "sglang":
        b = sglang.build(ctx)
    else:
        b = native.build(ctx, cluster_ref)
    b.readme = readme(b, plan, notes=[n for n in (address_note(plan, cluster), checkpoint_note(plan, model_path)) if n])
    b.check(plan)
    return b


def export_bundle(plan, cluster, engine: str, out_dir: str | Path, model_path: str, num_layers: int,
                  cluster_path: str | None = None, ray_port: int = RAY_PORT, replace: bool = False,
                  earlier: list[Path] | None = None, port_range=None) -> list[Path]:
    """Write ``plan``'s bundle for ``engine`` into ``out_dir``, new or empty (``replace``: or holding
    only an earlier bundle, removed once the new one is built; ``folder.py``); the cluster file is
    copied beside it (a hetserve bundle's ``hetserve serve`` reads it). ``earlier``: the folder's
    check, where the caller made it already (``check_bundle_folder``). Returns the paths written,
    the manifest ``bundle.json`` last."""
    if earlier is None:
        earlier = check_bundle_folder(out_dir, replace)
    ref = "cluster.yaml" if cluster_path else cluster.name
    b = build_bundle(plan, cluster, engine, model_path, num_layers, cluster_ref=ref, ray_port=ray_port,
                     port_range=port_range)
    # read before the earlier bundle goes: the cluster file may be that bundle's own cluster.yaml
    cluster_bytes = Path(cluster_path).read_bytes() if cluster_path else None
    remove_bundle(out_dir, earlier)  # only now: a plan the engine refuses leaves the earlier bundle whole
    written = b.write(out_dir, plan)
    if cluster_bytes is not None:
        (Path(out_dir) / "cluster.yaml").write_bytes(cluster_bytes)
        written.append(Path(out_dir) / "cluster.yaml")
    (Path(out_dir) / MANIFEST).write_text(manifest(written, out_dir, engine))
    return written + [Path(out_dir) / MANIFEST]


def readme(b: Bundle, plan, notes=()) -> str:
    """The bundle's README: what runs where, in which order to start it, and ``notes`` (what the
    export said of its input, as ``hetserve export`` prints it)."""
    lines = [f"# {b.engine} launch bundle: {plan.model} on {plan.cluster}", "",
             f"Made by `hetserve export --to {b.engine}` from `plan.json` ({plan.algorithm}). "
             f"Engine version the flags follow: {b.engine_version}.", "",
             "| replica | role | devices | endpoint |", "|---|---|---|---|"]
    for r in b.replicas:
        lines.append(f"| {r.id} | {r.role} | {' '.join(r.devices)} | {r.endpoint} |")
    steps = [install_step(b)]
    ray_on = _machines_with(b, "ray")
    if ray_on:  # a bundle that starts no Ray (vLLM or SGLang on one machine per replica) has no Ray step
        steps.append("The Ray nodes, on these machines only: "
                     + ", ".join(f"`bash machines/{m}.sh ray` on {m}" for m in ray_on) + ".")
    steps += ["The servers, on these machines only: "
              + ", ".join(f"`bash machines/{m}.sh serve` on {m}" for m in _machines_with(b, "server"))
              + ". A server prints when it is ready; a script ends all its servers when one exits.",
              router_step(b)]
    stop = "Stop with Ctrl-C in each script started with `serve`."
    if ray_on:
        stop += (" Then `ray stop` on " + ", ".join(ray_on) + ". It ends every Ray process on the machine that "
                 "its user may signal, not only this bundle's: every other Ray cluster of that user and, run as "
                 "root, other users' Rays too. Where others use Ray on the machine, end only this bundle's Ray "
                 "processes instead (docs/multinode.md, step 7).")
    lines += ["", "## Start, in this order", "",
              *(f"{n}. {text}" for n, text in enumerate(steps, start=1)), "",
              "A script runs from any folder: it changes to the bundle's folder first, where `plan.json` and "
              "the other files its commands name are.", "",
              stop, "",
              "`deploy.json` lists every process: its machine, GPU indices, argv and environment."]
    if b.engine == "vllm" and any("ray_address" in r.extra for r in b.replicas):
        lines += ["", "A replica over several machines runs on a Ray cluster of its own (its `ray_address`): "
                  "vLLM's Ray executor puts the head machine's GPUs first, as the plan's first stages."]
    if b.router.get("note"):
        lines += ["", f"Router: {b.router['note']}."]
    lines += [line for n in notes for line in ("", f"Note: {n}.")]
    return "\n".join(lines) + "\n"


def _machines_with(b: Bundle, kind: str) -> list[str]:
    """The machines (in the bundle's order) whose script starts a process of ``kind`` ("ray",
    "server"): a README step names only those, as a script run elsewhere would do nothing."""
    used = {x.machine for x in b.launches() if x.kind == kind}
    return [m for m in b.machines if m in used]


def install_step(b: Bundle) -> str:
    """The README's first step: what every machine needs before its script runs. hetserve is not on
    a package registry, so it is installed from a checkout, at the version that wrote the bundle."""
    from hetserve import __version__

    source = (f"hetserve {__version__}, the version that wrote this bundle (`hetserve --version` prints the one "
              "installed), from source, as hetserve is on no package registry: from a checkout at the same commit, "
              "`pip install '/path/to/hetserve[EXTRAS]'`")
    if b.engine == "hetserve":
        return ("On every machine put the model at the same path, and "
                + source.replace("EXTRAS", "runtime,ray") + "; and one Ray token, mode 600: "
                "`ray get-auth-token --generate`, docs/multinode.md (the scripts set `RAY_AUTH_MODE=token` unless "
                "the environment already sets it).")
    text = "Put the same engine version and the model at the same path on every machine"
    if b.router["argv"][:1] == ["hetserve"]:  # hetserve route fronts the engine's servers
        return text + "; on the router's machine also " + source.replace("EXTRAS", "runtime") + "."
    return text + "."


def _router_started(b: Bundle):
    """The server a machine's script starts that is the router itself (hetserve serve routes its own
    requests), or None where the router is a process of its own."""
    return next((x for x in b.launches() if x.kind == "server" and x.argv == b.router["argv"]), None)


def router_step(b: Bundle) -> str:
    """The README's last step: the router's command, or, where a script's server is the router, that
    there is nothing more to start (running its command again would take the same port)."""
    endpoint = b.router.get("endpoint", "its address")
    started = _router_started(b)
    if started is not None:
        return (f"No router to start: `{started.argv[0]} {started.argv[1]}`, started by `bash "
                f"machines/{started.machine}.sh serve` in the step above, is the router too (router.json). "
                f"Clients use {endpoint}.")
    return (f"The router on the first machine, from this folder (it reads deploy.json): "
            f"`{' '.join(b.router['argv'])}` (router.json); clients use {endpoint}.")
