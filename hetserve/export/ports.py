"""How many ports of ``hetserve serve --port-range`` each machine of a plan needs, and the refusal of
a range too small, made when the bundle is exported rather than when a server fails to start.

The rule is the runtime's (``hetserve.runtime.workers.rendezvous``: ``listen_socket`` and its
callers, ``needs_store``; docs/multinode.md): every worker — one per device of the plan — listens for its endpoint on its own
machine; the engine, on the serving machine, listens for its endpoint and, where the plan has a TP
group (a stage over several devices) or device channels are on, for the TP rendezvous store. gloo's
and NCCL's own sockets take ports outside the range and are not counted. The range applies to each
machine alike, so machines that share one address share its ports.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.errors import SpecError
from hetserve.runtime.workers.rendezvous import needs_store
from hetserve.specs.cluster import machine_of


@dataclass(frozen=True)
class Listeners:
    """The runtime's own listeners on one machine."""

    workers: int  # one endpoint per worker placed there
    engine: int = 0  # the engine's endpoint (serving machine only)
    store: int = 0  # the TP rendezvous store (serving machine, with TP groups or device channels)

    @property
    def ports(self) -> int:
        return self.workers + self.engine + self.store

    def describe(self) -> str:
        parts = [f"{self.workers} worker endpoint{'s' if self.workers != 1 else ''}"] if self.workers else []
        parts += ["the engine's endpoint"] * self.engine + ["the TP rendezvous store"] * self.store
        return ", ".join(parts)


def listeners_per_machine(plan, serving_machine: str, device_channels: bool = False) -> dict[str, Listeners]:
    """Each machine's listeners (in plan order, the serving machine included even without workers)."""
    workers: dict[str, int] = {}
    for d in plan.devices:
        workers[machine_of(d)] = workers.get(machine_of(d), 0) + 1
    store = int(needs_store((len(s.devices) for r in plan.replicas for s in r.stages), device_channels))
    out = {m: Listeners(n) for m, n in workers.items()}
    out[serving_machine] = Listeners(workers.get(serving_machine, 0), 1, store)
    return out


def check_port_range(port_range, plan, serving_machine: str, address, device_channels: bool = False) -> None:
    """Refuse (``SpecError`` on ``--port-range``, one line naming the machine and the count) a range
    with fewer ports than a host of the plan needs. ``address(machine)``: the host it listens on;
    machines sharing one add up."""
    if port_range is None:
        return
    per_host: dict[str, list[tuple[str, Listeners]]] = {}
    for m, lis in listeners_per_machine(plan, serving_machine, device_channels).items():
        per_host.setdefault(address(m), []).append((m, lis))
    size = port_range.hi - port_range.lo + 1
    for host, machines in per_host.items():
        need = sum(lis.ports for _, lis in machines)
        if need > size:
            names = " and ".join(m for m, _ in machines)
            what = (machines[0][1].describe() if len(machines) == 1
                    else "; ".join(f"{m}: {lis.describe()}" for m, lis in machines))
            where = f"machine {names}" if len(machines) == 1 else f"machines {names} (one address, {host})"
            raise SpecError("--port-range", SpecError.OPTION,
                            f"at least {need} ports: {where} listen{'s' if len(machines) == 1 else ''} on "
                            f"{need} ({what}); widen the range", str(port_range))
