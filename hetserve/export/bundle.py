"""The launch bundle every engine's exporter fills in, and the one writer of its files.

A bundle folder holds ``deploy.json`` (the docs/design.md deploy contract), ``plan.json``, one
``machines/<machine>.sh`` per machine of the plan, ``router.json`` and a ``README.md`` (this
module), the cluster file and ``bundle.json``, the list of files written (``export_bundle``,
``folder.py``).

Invariants (``Bundle.check``, run before anything is written):
* every device of the plan is in exactly one ``launch`` entry, on its own machine, with the index of
  its GPU on that machine (``a0:3`` → 3);
* a script starts exactly the processes placed on its machine: its Ray nodes (``kind`` ``ray``,
  which daemonise) in phase ``ray``, then its servers (in the background) in phase ``serve``.

A script takes the phase as its argument (``ray``, ``serve``; none: both): across machines, every
machine's ``ray`` phase runs before any ``serve`` phase, so a server that spans machines finds its
Ray cluster whole. It first changes to the bundle's folder (its own folder's parent), where the
relative paths in its commands (``plan.json``, ``cluster.yaml``) point, so it runs from anywhere.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from hetserve.errors import PlanError, SpecError


@dataclass
class Launch:
    """One process on one machine: ``argv`` with ``env`` added to the environment."""

    machine: str
    argv: list[str]
    gpu_indices: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # "ray": a Ray node (starts and returns); "server": runs until stopped; "actor": no process of
    # its own, the devices' workers are placed by a server of ``Bundle.shared`` (hetserve serve)
    kind: str = "server"
    note: str = ""

    def to_dict(self) -> dict:
        out = {"machine": self.machine, "gpu_indices": self.gpu_indices, "argv": self.argv, "env": self.env,
               "kind": self.kind}
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class ReplicaDeploy:
    id: str
    role: str
    devices: list[str]
    launch: list[Launch]
    endpoint: str
    extra: dict = field(default_factory=dict)  # engine specifics (KV connector, bootstrap port, ...)

    def to_dict(self) -> dict:
        return {"id": self.id, "role": self.role, "devices": self.devices,
                "launch": [x.to_dict() for x in self.launch], "endpoint": self.endpoint, **self.extra}


@dataclass
class Bundle:
    engine: str
    engine_version: str
    replicas: list[ReplicaDeploy]
    router: dict
    machines: dict[str, str]  # machine → address
    shared: list[Launch] = field(default_factory=list)  # processes of no one replica (a Ray head, hetserve serve)
    readme: str = ""
    extra: dict = field(default_factory=dict)
    preamble: list[str] = field(default_factory=list)  # shell lines every script runs first (exports)

    def deploy_dict(self) -> dict:
        out = {"engine": self.engine, "engine_version": self.engine_version, "plan": "plan.json",
               "replicas": [r.to_dict() for r in self.replicas], "router": self.router,
               "machines": {m: {"address": a, "script": f"machines/{m}.sh"} for m, a in self.machines.items()}}
        if self.shared:
            out["shared"] = [x.to_dict() for x in self.shared]
        out.update(self.extra)
        return out

    def launches(self) -> list[Launch]:
        return [x for r in self.replicas for x in r.launch] + self.shared

    def check(self, plan) -> None:
        """The module docstring's invariants; a broken one is a bug in an exporter."""
        seen: dict[str, str] = {}
        for r in self.replicas:
            for x in r.launch:
                for i in x.gpu_indices:
                    dev = f"{x.machine}:{i}"
                    if dev in seen:
                        raise PlanError(f"bundle: device {dev} launched twice ({seen[dev]} and {r.id})")
                    seen[dev] = r.id
        missing = sorted(set(plan.devices) - set(seen))
        extra = sorted(set(seen) - set(plan.devices))
        if missing or extra:
            raise PlanError(f"bundle: devices not launched {missing}, launched but not in the plan {extra}")
        self._check_ports()

    def _check_ports(self) -> None:
        """No two processes of one address listen on one port (a ``--port``, ``--...-port`` or
        ``..._PORT`` value, or a port inside a ``--port-range``): the second would fail to start.
        Ports come from the options (``--ray-port``, ``--port-range``) and the engines' defaults, so
        a clash is the user's to resolve, named with both commands."""
        taken: dict[tuple[str, int], str] = {}
        processes = [x for x in self.launches() if x.kind != "actor"]
        router = self.router.get("argv")
        if router and all(router != x.argv for x in processes):  # a router of its own (vLLM, SGLang)
            processes.append(Launch(option_value(router, "--host") or "", router))
        for x in processes:
            host = self.machines.get(x.machine, x.machine)
            who = f"{x.machine or host}: {shlex.join(x.argv)}"
            for port in _ports_of(x):
                first = taken.setdefault((host, port), who)
                if first != who:
                    raise SpecError("bundle", "ports", "each port of a machine taken by one process (choose "
                                    "another --ray-port or --port-range)", f"port {port} on {host} by both "
                                    f"`{first}` and `{who}`")

    def script(self, machine: str) -> str:
        """The bash script of ``machine``: its Ray nodes, then its servers (module docstring)."""
        mine = [x for x in self.launches() if x.machine == machine]
        ray = [x for x in mine if x.kind == "ray"]
        servers = [x for x in mine if x.kind == "server"]
        lines = ["#!/usr/bin/env bash",
                 f"# {self.engine} bundle: the processes placed on machine {machine} ({self.machines[machine]}).",
                 "# Usage: bash this-script [ray|serve]  (no argument: both). Run the ray phase on every",
                 "# machine before the serve phase on any (README.md). Runs from any folder.",
                 "set -euo pipefail",
                 # the commands name the bundle's files (plan.json, cluster.yaml) relative to its folder
                 'cd "$(dirname "$0")/.."',
                 *self.preamble,
                 'phase="${1:-all}"',
                 'case "$phase" in ray|serve|all) ;; *) echo "usage: $0 [ray|serve]" >&2; exit 2;; esac',
                 'if [ "$phase" != serve ]; then']
        lines += [f"  {_command(x)}" for x in ray] or ["  :"]
        lines += ["fi",
                  'if [ "$phase" != ray ]; then',
                  "  pids=()",
                  "  # a server that exits takes the others on this machine down with it",
                  '  trap \'kill "${pids[@]}" 2>/dev/null || true\' EXIT INT TERM']
        for x in servers:
            lines += [f"  {_command(x)} &", '  pids+=("$!")']
        lines += ['  if [ "${#pids[@]}" -gt 0 ]; then wait -n "${pids[@]}"; fi', "fi", ""]
        return "\n".join(lines)

    def write(self, out_dir: str | Path, plan) -> list[Path]:
        """Write the bundle's files into ``out_dir`` (created); returns the paths written."""
        self.check(plan)
        out = Path(out_dir)
        (out / "machines").mkdir(parents=True, exist_ok=True)
        written = []
        plan.save(out / "plan.json")
        written.append(out / "plan.json")
        for name, text in (("deploy.json", json.dumps(self.deploy_dict(), indent=1) + "\n"),
                           ("router.json", json.dumps(self.router, indent=1) + "\n"),
                           ("README.md", self.readme)):
            (out / name).write_text(text)
            written.append(out / name)
        for m in self.machines:
            p = out / "machines" / f"{m}.sh"
            p.write_text(self.script(m))
            p.chmod(0o755)
            written.append(p)
        return written


def _command(x: Launch) -> str:
    env = [f"{k}={shlex.quote(v)}" for k, v in x.env.items()]
    return " ".join((["env"] + env if env else []) + [shlex.quote(a) for a in x.argv])


def option_value(argv: list[str], option: str) -> str | None:
    """The value after ``option`` in ``argv`` (None where it is not given)."""
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == option), None)


def _ports_of(x: Launch) -> list[int]:
    """The ports ``x`` listens on, as its options and environment name them. A follower node of a
    multi-node server (``--node-rank`` above 0) repeats its head's options but listens on none."""
    ports: list[int] = []
    pairs = list(zip(x.argv, x.argv[1:]))
    if option_value(x.argv, "--node-rank") not in (None, "0"):
        pairs = []
    for opt, value in pairs:
        if opt == "--port-range" and "-" in value:
            lo, hi = value.split("-", 1)
            if lo.isdigit() and hi.isdigit():
                ports += range(int(lo), int(hi) + 1)
        elif opt.startswith("--") and opt.endswith("port") and value.isdigit():
            ports.append(int(value))
    ports += [int(v) for k, v in x.env.items() if k.endswith("_PORT") and v.isdigit()]
    return ports
