"""What every exporter reads from a plan: machine addresses, ports, GPU indices, request weights."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hetserve.listing import and_more
from hetserve.specs.cluster import machine_of

# Ports a bundle hands out, each counting up per replica (or per machine) from its base. Fixed
# bases so a firewall rule can be written from the README; none collides with Ray's 6379 or
# hetserve serve's 8000.
ENDPOINT_PORT = 8100  # each replica's OpenAI-compatible server
ROUTER_PORT = 8000  # hetserve route (or the engine's router)
SIDE_PORT = 5600  # vLLM NIXL side channel / SGLang --dist-init-addr / --disaggregation-bootstrap-port
RAY_PORT = 6379  # a Ray head's GCS port (one Ray cluster per multi-machine vLLM replica)


def machines_without_address(plan, cluster) -> list[str]:
    """The plan's machines (in plan order) the cluster file gives no ``address``: the scripts name
    them by their machine names instead (``ExportContext.address``)."""
    out: list[str] = []
    for d in plan.devices:
        m = machine_of(d)
        if m not in cluster.machine_addresses and m not in out:
            out.append(m)
    return out


def address_note(plan, cluster) -> str | None:
    """What to tell the user where some of the plan's machines have no ``address`` (None where all have)."""
    missing = machines_without_address(plan, cluster)
    if not missing:
        return None
    many = len(missing) > 1
    return (f"cluster '{cluster.name}' gives no `address` for machine{'s' if many else ''} {and_more(missing)}: "
            f"the scripts use {'their names' if many else 'its name'} as host names instead (e.g. "
            f"`--host {missing[0]}`), which every machine must resolve on the pool's network; add `address: IP` "
            f"to {'each of them' if many else 'it'} in the cluster file and export again")


def checkpoint_note(plan, model_path: str) -> str | None:
    """What to tell the user where the scripts load the checkpoint by this machine's own path (a
    folder here, given or named by the plan): every machine of the plan must hold it there too
    (None for a hub name, a preset's name or a path that is not here)."""
    if not (os.path.isabs(model_path) and os.path.exists(model_path)):
        return None
    machines = list(dict.fromkeys(machine_of(d) for d in plan.devices))
    return (f"the scripts load the checkpoint from {model_path}, its path on this machine: "
            f"{'each of ' + and_more(machines) if len(machines) > 1 else machines[0]} must hold it at that path "
            "(copy it there, or export again with --model naming where the machines hold it)")


@dataclass
class ExportContext:
    """One export: the plan, its cluster, the model path on every machine, and the ports handed out."""

    plan: object
    cluster: object
    model_path: str
    num_layers: int
    router_host: str | None = None
    ray_port: int = RAY_PORT  # the hetserve bundle's Ray head (vLLM replicas' Ray heads count up from it + 1)
    # the hetserve bundle's `hetserve serve --port-range` (a rendezvous.PortRange): the ports its own
    # listeners take theirs from on every machine; None: ports the OS picks
    port_range: object = None
    _next: dict = field(default_factory=dict)

    def address(self, machine: str) -> str:
        """The cluster file's ``address`` of the machine, else its name (resolved by the machines' DNS;
        ``address_note`` says so)."""
        return self.cluster.machine_addresses.get(machine, machine)

    def port(self, kind: str, machine: str, base: int, width: int = 1) -> int:
        """The first of ``width`` consecutive free ports of ``kind`` on ``machine``, counting from ``base``
        (vLLM's NIXL side channel takes its port plus the worker's rank: one port per worker)."""
        n = self._next.get((kind, machine), 0)
        self._next[(kind, machine)] = n + width
        return base + n

    @property
    def machines(self) -> dict[str, str]:
        """Every machine the plan uses, in plan order → its address."""
        out: dict[str, str] = {}
        for d in self.plan.devices:
            m = machine_of(d)
            out.setdefault(m, self.address(m))
        return out

    @property
    def head_machine(self) -> str:
        return machine_of(self.plan.replicas[0].devices[0])

    def entry_weights(self) -> dict[str, float]:
        """Share of requests each entry replica (prefill or colocated) takes: the plan's flow through
        it (its capacity where the plan has no flow, equal shares where it has neither), summing to 1."""
        per = self.plan.estimate.get("replicas", {}) if isinstance(self.plan.estimate, dict) else {}
        entry = [r for r in self.plan.replicas if r.role in ("prefill", "colocated")]
        raw = {}
        for r in entry:
            info = per.get(r.id, {})
            raw[r.id] = float(info.get("flow_requests_per_period") or info.get("capacity_requests_per_period") or 0.0)
        if sum(raw.values()) <= 0:
            raw = {r.id: 1.0 for r in entry}
        total = sum(raw.values())
        return {k: round(v / total, 6) for k, v in raw.items()}

    def kv_routes(self) -> list[dict]:
        return [{"from": k.src, "to": k.dst, "weight": k.weight} for k in self.plan.kv_routes]

    def router(self, deploy_argv_extra: list[str] | None = None) -> dict:
        """hetserve route in front of the replicas' endpoints, on the head machine."""
        host = self.router_host or self.address(self.head_machine)
        argv = ["hetserve", "route", "--deploy", "deploy.json", "--host", host, "--port", str(ROUTER_PORT)]
        return {"argv": argv + (deploy_argv_extra or []), "weights": self.entry_weights(),
                "kv_routes": self.kv_routes(), "endpoint": f"http://{host}:{ROUTER_PORT}"}
