"""The KV routes between machines in the bounds' programmes, summed by site where that is exact.

Both bounds split the prefill → decode flow into KV routes between machines and load every NIC
and pipe a route crosses with its KV bytes. Per machine pair (``u[m, m']``) that is M² variables:
30,000 at 1,024 GPUs (174 machines), 470,000 at 4,096 (686) — what made the programme's solve grow
faster than the pool. Where no dedicated machine-to-machine link exists, a route's resources
depend only on its two machines' NICs and their two sites' pipe, so ``RouteVars`` keeps per
machine m (site s): ``l[m]`` (KV that stays on m), ``os[m]`` / ``is[m]`` (to / from the other
machines of s), ``ox[m]`` / ``ix[m]`` (to / from other sites) and per site pair ``v[s, s']``,
with Σ_{m∈s} os = Σ_{m∈s} is, Σ_{m∈s} ox = Σ_{s'} v[s, s'], Σ_{m∈s'} ix = Σ_s v[s, s'].
5·M + S·(S − 1) variables.

Why the bound stays the same. *A relaxation*: any routes u give l = u[m, m], os / ox = the sums
of u[m, ·] over the other machines of m's site / of other sites, is / ix likewise over u[·, m],
v[s, s'] = Σ u over s × s'; every row holds (each NIC and pipe carries the same bytes) and the
flow is the same, so the optimum cannot fall. *No looser*: from any such point routes u are
rebuilt — ox[m] split over destination sites and ix[m'] over source sites to match v, then
within each site pair the one matched to the other (transport problems on complete bipartite
graphs with equal totals are feasible); inside a site, os against is without the diagonal, which is feasible
once what a machine would send to itself (os[m] + is[m] − Σ_{m∈s} os, where positive) is moved
to l[m] — less NIC traffic, same flow. So the optimum cannot rise either.
"""

from __future__ import annotations

from hetserve.planner.bound.rows import resource_rows


def sums_by_site(topology) -> bool:
    """Routes are summed by site where every route's resources are its machines' NICs and its
    sites' pipe: a topology without dedicated machine links (a matrix cluster has none to share)."""
    return topology is not None and not topology.links


class RouteVars:
    """The KV route variables from index ``start`` over ``machines`` (names, sorted) of ``kinds``
    (anything with ``machine`` and a representative ``device``): by site where the cluster has no
    dedicated machine links, else per machine pair (``iu``). ``nv``: the end of the variables."""

    def __init__(self, ctx, kinds, machines: list[str], start: int):
        self.ctx, self.kinds, self.machines = ctx, kinds, machines
        topo = ctx.cluster.topology
        self.by_site = sums_by_site(topo)
        i = start
        if not self.by_site:
            self.iu = {(a, b): i + j for j, (a, b) in enumerate((a, b) for a in machines for b in machines)}
            self.nv = i + len(self.iu)
            return
        self.site = {m: topo.machine_site[m] for m in machines}
        self.sites = sorted(set(self.site.values()))
        self.il = {m: i + 5 * j for j, m in enumerate(machines)}  # then os, is, ox, ix
        i += 5 * len(machines)
        self.iv = {(a, b): i + j for j, (a, b) in enumerate((a, b) for a in self.sites for b in self.sites if a != b)}
        self.nv = i + len(self.iv)

    def all(self) -> dict[int, float]:
        """Every route once: Σ = the flow they carry."""
        if not self.by_site:
            return {i: 1.0 for i in self.iu.values()}
        return {self.il[m] + k: 1.0 for m in self.machines for k in (0, 1, 3)}

    def leaving(self, m: str) -> dict[int, float]:
        """The routes of KV prefilled on ``m`` (the KV that stays there included)."""
        if not self.by_site:
            return {i: 1.0 for (a, _), i in self.iu.items() if a == m}
        return {self.il[m]: 1.0, self.il[m] + 1: 1.0, self.il[m] + 3: 1.0}

    def reaching(self, m: str) -> dict[int, float]:
        """The routes of KV decoded on ``m`` (the KV that stays there included)."""
        if not self.by_site:
            return {i: 1.0 for (_, b), i in self.iu.items() if b == m}
        return {self.il[m]: 1.0, self.il[m] + 2: 1.0, self.il[m] + 4: 1.0}

    def rows(self, row) -> None:
        """The sums that tie machines to sites, and each NIC and pipe's capacity."""
        if not self.by_site:
            resource_rows(self.ctx, self.kinds, self.iu, row)
            return
        ctx = self.ctx
        kv = ctx.input_tokens * ctx.model.kv_bytes_per_token
        cap = ctx.resource_cap
        topo = ctx.cluster.topology
        for s in self.sites:
            here = [m for m in self.machines if self.site[m] == s]
            row.equal({**{self.il[m] + 1: 1.0 for m in here}, **{self.il[m] + 2: -1.0 for m in here}}, 0.0,
                      f"KV between machines of {s}")
            row.equal({**{self.il[m] + 3: 1.0 for m in here},
                       **{i: -1.0 for (a, _), i in self.iv.items() if a == s}}, 0.0, f"KV leaving {s}")
            row.equal({**{self.il[m] + 4: 1.0 for m in here},
                       **{i: -1.0 for (_, b), i in self.iv.items() if b == s}}, 0.0, f"KV reaching {s}")
        for m in self.machines:
            for name, (a, b) in ((topo.nic_out[m].name, (1, 3)), (topo.nic_in[m].name, (2, 4))):
                if name in cap:
                    row({self.il[m] + a: kv, self.il[m] + b: kv}, cap[name], f"network {name}")
        for (a, b), i in self.iv.items():
            pipe = topo.pipes.get((a, b))
            if pipe is not None and pipe.name in cap:
                row({i: kv}, cap[pipe.name], f"network {pipe.name}")
