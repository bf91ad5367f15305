"""How ``hetserve plan`` prints plans: one plan with its estimate, several side by side, what
bounds a plan and what more hardware would give (``--explain``), and what an engine's rules cost."""

from __future__ import annotations

BUSIEST_RESOURCES = 4  # shared NICs / pipes printed under a plan


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _devices(replica) -> str:
    """Devices grouped by machine: ``a0:0-3, b0:1``."""
    by_machine: dict[str, list[int]] = {}
    for d in replica.devices:
        m, _, i = d.rpartition(":")
        by_machine.setdefault(m, []).append(int(i))
    parts = []
    for m, idx in by_machine.items():
        idx.sort()
        runs, start = [], idx[0]
        for a, b in zip(idx, idx[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        parts.append(f"{m}:{','.join(runs)}")
    return " ".join(parts)


def print_plan(console, plan) -> None:
    from rich.table import Table

    from hetserve.cli.replica_tables import MAX_ROWS, plan_table

    e = plan.estimate
    t = plan_table(plan, f"{plan.algorithm}: {plan.model} on {plan.cluster}",
                   f"req/T: requests per period T = {e.get('period_s', 600):g} s (cost model estimate)" if e else None,
                   _devices)
    console.print(t)
    if len(plan.kv_routes) > MAX_ROWS:  # a fleet's routes: how many, between how many replicas
        w = [k.weight for k in plan.kv_routes]
        console.print(f"KV routes: {len(w):,} from {len({k.src for k in plan.kv_routes}):,} prefill to "
                      f"{len({k.dst for k in plan.kv_routes}):,} decode replicas, weights (∝ max flow) "
                      f"{min(w):.3g} to {max(w):.3g} (each route in the plan file)")
    elif plan.kv_routes:
        routes = Table(title="KV routes (weights ∝ max flow)")
        routes.add_column("from")
        routes.add_column("to")
        routes.add_column("weight", justify="right")
        for k in plan.kv_routes:
            # a route the max flow sends a sliver over is no route of weight 0: its share is shown
            routes.add_row(k.src, k.dst, f"{k.weight:.3f}" if k.weight >= 5e-4 or k.weight == 0 else f"{k.weight:.1e}")
        console.print(routes)
    if not e:  # a hand-written plan (the bundled examples): say so rather than print zeros
        console.print("this plan file holds no estimate (written by hand, not by `hetserve plan`): "
                      "`hetserve simulate --plan FILE` predicts how it serves")
        return
    usd = e.get("cost_usd_per_hour")
    search = e.get("search", {})
    # under SLO objectives the capacities, the plan's value and its bound all count what meets the SLOs
    within_slo = " within the SLOs" if "slo" in e else ""
    # a figure the estimate lacks (a file written by hand or by another tool) is left out, not printed as 0 or None
    requests = (f" ({e['requests_per_period']:,.0f} requests per {e.get('period_s', 600):.0f} s)"
                if "requests_per_period" in e else "")
    devices = (f"{e['devices_used']}/{e['devices_total']}" if "devices_used" in e and "devices_total" in e
               else str(len(plan.devices)))
    per_usd = f" ({e['tokens_per_usd']:,.0f} output tokens/$)" if "tokens_per_usd" in e else ""
    console.print(
        f"estimated throughput{within_slo} [bold]{e.get('throughput_tokens_per_s', 0):,.1f} output tokens/s[/bold]"
        f"{requests}; {devices} devices; "
        + (f"${usd:,.2f}/hour{per_usd}" if usd is not None else "price unknown")
        + _planned_in(e, search))
    ub = e.get("upper_bound_tokens_per_s")
    if ub:
        scope = (f"no placement within ${e['budget_usd_per_hour']:,.2f}/h" if "budget_usd_per_hour" in e
                 else "no placement of this pool")
        console.print(f"{100 * e.get('throughput_tokens_per_s', 0) / ub:.1f} % of the bound: "
                      f"{scope} exceeds {ub:,.1f} tokens/s{within_slo} under the cost model "
                      f"(group-column and per-device relaxations, planner/bound/throughput.py; its solver ran "
                      f"{e.get('upper_bound_wall_s', 0):.2g} s)")
        if e.get("upper_bound_cut_short"):
            console.print("the bound's solver stopped at the time limit, unfinished: still a bound, a looser one "
                          "than it would prove with more time (a longer --time-limit tightens it)")
    if "goodput_requests_per_s" in e:
        slo = e.get("slo", {})
        console.print(f"goodput {e['goodput_requests_per_s']:,.3f} requests/s within TTFT ≤ {slo.get('ttft_s')} s, "
                      f"TPOT ≤ {slo.get('tpot_s')} s (estimate: M/D/1 prefill queue, KV hand-offs queueing on shared "
                      "links, decode batch within the TPOT)")
    if "budget_usd_per_hour" in e:
        whose = ("the cheapest budget tried that serves the rate" if "rate_requests_per_s" in e
                 else "budget")  # --objective cost searches budgets: none was given
        console.print(f"{whose} ${e['budget_usd_per_hour']:,.2f}/h: plan uses ${usd or 0:,.2f}/h")
    if "rate_requests_per_s" in e:
        console.print(f"cheapest found for {e['rate_requests_per_s']:g} requests/s: ${usd or 0:,.2f}/h "
                      f"(no subset can cost less than ${e['min_cost_bound_usd_per_hour']:,.2f}/h: planner/bound/min_cost.py)")
    network = e.get("network") or {}
    if network:
        # busiest first whatever order the file kept (a YAML plan's keys come back sorted)
        busiest = sorted(network.items(), key=lambda kv: -kv[1].get("utilisation", 0.0))[:BUSIEST_RESOURCES]
        console.print("busiest shared links (planned / capacity): " + "; ".join(
            f"{name} {v['planned_gbps']:.3g}/{v['capacity_gbps']:.3g} Gbit/s ({v['utilisation']:.0%})"
            for name, v in busiest))
    if e.get("notes"):
        console.print(f"note: {e['notes']}")
    if e.get("pricing"):
        console.print(_priced_by(e["pricing"]))
    if e.get("calibration"):
        console.print(f"efficiencies: the {e['calibration']}")


def _priced_by(pricing: dict) -> str:
    """How the cost model priced each GPU type (fitted kernel model, transferred, roofline)."""
    from hetserve.cost.kernel_pricing import describe_pricing

    return f"priced by: {describe_pricing(pricing)} (docs/cost-model.md)"


def _planned_in(e: dict, search: dict) -> str:
    """How long planning took: the whole search where a budget or the cost objective ran several
    inner searches (``objective_search``), with the chosen one's own figures beside it."""
    if not search:
        return ""
    own = (f"{_count(search.get('iterations', 0), 'search iteration')}, {search.get('stopped_by')}; the "
           f"alternatives and the bound included")
    whole = e.get("objective_search")
    if not isinstance(whole, dict):
        return f"; planned in {search.get('wall_s', 0):.1f} s ({own})"
    return (f"; planned in {whole.get('wall_s', 0):.1f} s in all ({_count(whole.get('inner_plans', 0), 'inner plan')} "
            f"over the budgets and device subsets tried; the chosen one {search.get('wall_s', 0):.1f} s: {own})")


def print_comparison(console, plans) -> None:
    from rich import box
    from rich.table import Table

    # no rules between columns, P/D/C in one: ten bordered columns cut headers to "sear…" and "$/…" at 80
    # characters; where even this is too wide, the algorithm's name folds, never a number
    t = Table(title=f"{plans[0].model} on {plans[0].cluster}", box=box.SIMPLE_HEAD, show_edge=False,
              collapse_padding=True, pad_edge=False)
    for col in ("algorithm", "tokens/s", "req/T", "P/D/C", "GPUs", "$/h", "search s", "iters"):
        t.add_column(col, justify="left" if col == "algorithm" else "right", no_wrap=col != "algorithm",
                     overflow="fold")
    base = max(p.estimate.get("throughput_tokens_per_s", 0.0) for p in plans) or 1.0
    for p in plans:
        e = p.estimate
        s = e.get("search", {})
        usd = e.get("cost_usd_per_hour")
        tps = e.get("throughput_tokens_per_s", 0.0)
        t.add_row(p.algorithm, f"{tps:,.1f} ({tps / base:.0%})", f"{e.get('requests_per_period', 0):,.0f}",
                  "/".join(str(len(p.by_role(r))) for r in ("prefill", "decode", "colocated")),
                  f"{e.get('devices_used')}/{e.get('devices_total')}", "–" if usd is None else f"{usd:,.2f}",
                  f"{(e.get('objective_search') or s).get('wall_s', 0):.2f}", str(s.get("iterations", 0)))
    console.print(t)
    periods = sorted({p.estimate.get("period_s", 600) for p in plans})
    console.print("tokens/s: output tokens per second; P/D/C: prefill, decode and colocated replicas; "
                  "GPUs: used / in the pool; "
                  f"req/T: requests per period T = {', '.join(f'{x:g}' for x in periods)} s")
    # the algorithms share one cost model: its pricing is said once (each distinct one, were they to differ)
    pricings = list(dict.fromkeys(_priced_by(p.estimate["pricing"]) for p in plans if p.estimate.get("pricing")))
    within = " within the SLOs" if any("slo" in p.estimate for p in plans) else ""
    console.print(f"tokens/s and req/T: the planner's estimates{within} under the cost model"
                  + ("; " + "; ".join(pricings) if pricings else ""))


def print_explanation(console, plan, args, cluster, model, workload, options, fn) -> None:
    from rich.table import Table

    from hetserve.planner.explain import bottlenecks, plan_tokens_per_s, what_if_options, what_ifs
    from hetserve.planner.options import DEFAULT_TIME_LIMIT_S

    console.print("[bold]what bounds this plan[/bold] (min cut of its flow):")
    for line in bottlenecks(plan, cluster, model, workload, options):
        console.print(f"  • {line}")
    plain = what_if_options(options)
    # the rows' base is this plan priced as they are (the evaluator, their options), so an unchanged
    # plan reads +0.0 %, never the rounding of its estimate
    base = plan_tokens_per_s(plan, cluster, model, workload, plain)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    no_bar = args.quiet or not console.is_terminal  # off a terminal the bar would leave a blank line
    with Progress(TextColumn("[bold]what-ifs[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True, disable=no_bar) as bar:
        task = bar.add_task("", total=None)

        def on_variant(i, n, label):
            if i == 0:  # each re-plan is a search of its own: say what that costs before the first
                console.print(f"what-ifs: {n} quick re-plans, each up to the time limit "
                              f"({options.time_limit_s or DEFAULT_TIME_LIMIT_S:g} s) plus its pool's bound "
                              f"columns (seconds on a large pool)")
            bar.update(task, total=n, completed=i, description=label)

        rows = what_ifs(plan, args.cluster, model, workload, plain, fn, on_variant=on_variant)
    if not rows:
        console.print("  (what-ifs need a cluster file with machines, not a device matrix)")
        return
    within = " within the SLOs" if "slo" in plan.estimate else ""
    t = Table(title=f"what-ifs: the better of this plan on the edited pool and a quick re-plan "
                    f"({plan.algorithm}, fewer restarts)",
              caption=f"vs plan: against this plan's {base:,.1f} tokens/s{within}"
                      f"; upper bound: the edited pool's (planner/bound/throughput.py); all estimates under the "
                      f"cost model, priced as above")
    for col in ("change", "tokens/s", "vs plan", "from", "upper bound"):
        t.add_column(col, justify="right" if col in ("tokens/s", "vs plan", "upper bound") else "left")
    for r in rows:
        v = r.tokens_per_s
        t.add_row(r.change, "–" if v is None else f"{v:,.1f}",
                  "–" if v is None or not base else f"{v / base - 1:+.1%}", r.source,
                  (f"{r.upper_bound:,.0f}" + (" *" if r.cut_short else "")) if r.upper_bound else "–")
    console.print(t)
    for r in rows:
        if r.note:
            console.print(f"  {r.change}: {r.note}")
    if any(r.cut_short for r in rows):
        console.print("  * the bound's solver stopped at the time limit, unfinished: still a bound, but looser by "
                      "however far it had got, so starred bounds do not compare with each other or with the "
                      "plan's (a longer --time-limit tightens them)")


def print_engine_cost(console, plan, cluster, model, workload, options, hexgen2) -> None:
    """What the engine's rules cost: this plan's estimate beside an unrestricted hexgen2 plan's and the
    bound (a second search with the same options and time limit)."""
    from hetserve.planner.explain import engine_cost

    row = engine_cost(plan, cluster, model, workload, options, hexgen2)
    ub = row["upper_bound_tokens_per_s"]
    console.print(f"[bold]what {options.engine}'s rules cost[/bold]: {row['engine_tokens_per_s']:,.1f} tokens/s under "
                  f"them, {row['unrestricted_tokens_per_s']:,.1f} unrestricted (hexgen2, same options) "
                  f"({row['engine_tokens_per_s'] / max(row['unrestricted_tokens_per_s'], 1e-9) - 1:+.1%}); "
                  + (f"bound {ub:,.1f} tokens/s" if ub else "no bound"))
