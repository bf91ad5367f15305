"""How ``hetserve describe cluster`` prints a pool: its machines, the links between them and the
shared network resources. A pool of a few machines is listed row by row; a fleet's rows are
grouped (machines of one shape, machine pairs with one link, resources with one capacity), each
group with its count and a few of its names, so 1,000 GPUs read in a page, not 15,000 lines."""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.table import Table

from hetserve.listing import NAMES_SHOWN, some
from hetserve.specs.cluster import GBPS, Cluster
from hetserve.specs.cluster_file import intra_link_kind

# rows a table lists one by one; past it, rows with the same figures are grouped into one (every
# preset stays within it: 9 machines, 36 pairs)
MAX_ROWS = 40


def _fmt_link(latency_s: float, bandwidth: float) -> str:
    return f"{bandwidth / GBPS:,.1f} Gbps / {latency_s * 1e3:g} ms"


def _price_source(c: Cluster, devs) -> str:
    """Where a machine's $/h comes from: the GPU table's price, or the file's ``gpu_usd_per_hour``."""
    return "gpus.csv" if "gpu_usd_per_hour" not in c.machine_fields.get(devs[0].machine, ()) else "file"


def _intra_source(c: Cluster, devs) -> str:
    if c.topology is None:
        return "matrix"
    if "intra" in c.machine_fields.get(devs[0].machine, ()):
        return "file"
    return f"default {intra_link_kind(devs[0].gpu)}"


def describe_cluster(c: Cluster, console: Console) -> None:
    price = c.usd_per_hour()
    if price is not None:
        priced = f"${price:,.2f}/h (GPU prices: gpus.csv typical_cloud_usd_per_hour, or a machine's gpu_usd_per_hour)"
    else:
        unpriced = sorted({d.gpu.name for d in c.devices if d.gpu.usd_per_hour is None})
        priced = (f"price unknown: {', '.join(unpriced)} {'has' if len(unpriced) == 1 else 'have'} no price in gpus.csv "
                  "(give gpu_usd_per_hour on its machines in the cluster file)")
    console.print(f"[bold]cluster {c.name}[/]: {len(c)} devices on {len(c.machines):,} machines, {len(c.sites):,} "
                  f"site{'s' * (len(c.sites) != 1)}, {_fmt_gb(c)}, " + priced)
    if c.description:
        console.print(c.description)
    _machines(c, console)
    _links(c, console)
    _describe_shared(c, console)
    for label, text in (("source", c.source), ("assumptions", c.assumptions)):
        if text:
            console.print(f"[bold]{label}:[/] {text.strip()}")


def _fmt_gb(c: Cluster) -> str:
    from hetserve.specs.gpus import fmt_gb

    return fmt_gb(c.total_memory_bytes)


def _machines(c: Cluster, console: Console) -> None:
    rows: dict[tuple, list[tuple[str, str]]] = {}  # a machine's figures -> its (name, site)s
    for name, devs in c.machines.items():
        d0 = devs[0]
        intra = (f"{_fmt_link(*c.link(devs[0].index, devs[1].index))} ({_intra_source(c, devs)})"
                 if len(devs) > 1 else "-")
        p = c.usd_per_hour([d.index for d in devs])
        figures = (f"{len(devs)}× {d0.gpu.name}", f"{sum(d.memory_bytes for d in devs) / 1e9:,.3g}", intra,
                   f"{p:,.2f} ({_price_source(c, devs)})" if p is not None else "unknown")
        rows.setdefault(figures, []).append((name, d0.site))
    grouped = len(c.machines) > MAX_ROWS
    title = (f"machines ({len(c.machines):,}; machines of the same GPUs, link and price in one row)" if grouped
             else "machines")
    t = Table(title=title)
    # names are kept whole (a narrow console wraps the links and prices instead), never cut to "H100-SXM-8…"
    first = ("machines", "sites") if grouped else ("machine", "site")
    for col in (*first, "GPUs", "memory GB", "intra-box link (from)", "$/h (from)"):
        t.add_column(col, no_wrap=col in ("machine", "site", "GPUs"), overflow="fold")
    for figures, named in rows.items():
        if grouped:
            sites = list(dict.fromkeys(s for _, s in named))
            t.add_row(some([n for n, _ in named]), some(sites), *figures)
        else:
            for name, site in named:
                t.add_row(name, site, *figures)
    console.print(t)


def _links(c: Cluster, console: Console) -> None:
    names = list(c.machines)
    if len(names) < 2:
        return
    first = [c.machines[m][0] for m in names]
    pairs = len(names) * (len(names) - 1) // 2
    if pairs <= MAX_ROWS:
        t = Table(title="links between machines")
        for col in ("from", "to", "link"):
            t.add_column(col)
        for i, a in enumerate(first):
            for b in first[i + 1:]:
                t.add_row(a.machine, b.machine, _fmt_link(*c.link(a.index, b.index)))
        console.print(t)
        return
    # one row per link figure, within a site and between sites apart: read off the device matrices
    # in one pass (a Python loop over 14,000 pairs of 171 machines is most of the time)
    idx = np.array([d.index for d in first])
    lat, bw = c.latency[np.ix_(idx, idx)], c.bandwidth[np.ix_(idx, idx)]
    site = np.array([d.site for d in first])
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for i, j in zip(*np.triu_indices(len(names), 1)):
        scope = "within a site" if site[i] == site[j] else "between sites"
        groups.setdefault((scope, _fmt_link(lat[i, j], bw[i, j])), []).append((i, j))
    t = Table(title=f"links between machines ({pairs:,} pairs; pairs with the same link in one row)")
    for col in ("pairs", "link", "machine pairs", "e.g."):
        t.add_column(col, justify="right" if col == "machine pairs" else "left")
    for (scope, link), members in groups.items():
        t.add_row(scope, link, f"{len(members):,}",
                  some([f"{names[i]} ↔ {names[j]}" for i, j in members[:NAMES_SHOWN]], NAMES_SHOWN))
    console.print(t)


def _describe_shared(c: Cluster, console: Console) -> None:
    """NICs (each direction) and site pipes / dedicated links: what concurrent transfers share."""
    shared = c.shared_resources()
    if not shared or len(c.machines) < 2:
        return
    rows: list[tuple[str, str, str, str]] = []
    seen = set()
    for r in shared:
        if r.kind in ("pipe", "link"):
            a, b = r.name.split(":", 1)[1].split(">")
            if (b, a) in seen:
                continue  # a pipe is listed once: both directions have the same figures
            seen.add((a, b))
            label = f"{r.kind} {a} ↔ {b}"
        else:
            label = r.name
        cap = "unlimited (no nic / intra_site given)" if not np.isfinite(r.bandwidth) else f"{r.bandwidth / GBPS:,.3g} Gbps"
        rows.append((label, r.kind.replace("_", " "), cap, f"{r.latency_s * 1e3:g} ms"))
    grouped = len(rows) > MAX_ROWS
    title = "shared network resources (each direction; every transfer crossing one shares it)"
    t = Table(title=title + ("; resources of the same kind and figures in one row" if grouped else ""))
    for col in ("resources" if grouped else "resource", "kind", "capacity", "latency"):
        t.add_column(col)
    if not grouped:
        for row in rows:
            t.add_row(*row)
    else:
        groups: dict[tuple[str, str, str], list[str]] = {}
        for label, *figures in rows:
            groups.setdefault(tuple(figures), []).append(label)
        for figures, labels in groups.items():
            t.add_row(some(labels), *figures)
    console.print(t)
