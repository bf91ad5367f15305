"""``hetserve cost layer``: what one layer costs on one TP rank of a GPU, from the kernel cost model;
``hetserve cost fit``: fit that model to a folder of measured operator times."""

from __future__ import annotations

import argparse
import json
import sys

from hetserve.errors import SpecError


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cost", help="the kernel cost model: one layer's cost on a GPU; fit it to measurements",
                       description="Per-operator GPU cost model fitted on measured kernel times "
                                   "(docs/cost-model.md).")
    cmds = p.add_subparsers(dest="cost_command", required=True)
    layer = cmds.add_parser("layer", help="one layer on one TP rank: linear_s, layer_s, allreduce_s",
                            description="What one transformer layer costs on one TP rank of GPU, per TP degree "
                                        "and token count. Each figure says whether it is fitted from "
                                        "measurements of that GPU or transferred to it.")
    layer.add_argument("--gpu", required=True, help="a GPU name from hetserve/data/gpus.csv (an unknown "
                       "name is refused with the list of known ones)")
    layer.add_argument("--model", required=True, help="a model preset, config.json or checkpoint folder")
    layer.add_argument("--tp", type=_ints, default=(1, 2, 4, 8), help="TP degrees, comma-separated (default 1,2,4,8)")
    layer.add_argument("--tokens", type=_ints, default=(1, 64, 4096),
                       help="tokens in the step, comma-separated (default 1,64,4096)")
    layer.add_argument("--table", help="a kernel-cost file from `hetserve cost fit -o` (default: the bundled one)")
    layer.add_argument("--json", action="store_true", help="JSON rows {gpu, model, tp, tokens, linear_s, layer_s, "
                       "allreduce_s, source, extrapolated} on stdout (the sources described on stderr)")
    layer.set_defaults(func=run_layer)
    fit = cmds.add_parser("fit", help="fit the kernel cost model to a profile folder",
                          description="Fit per-GPU kernel parameters, the transfer rule for GPUs without "
                                      "profiles and the all-reduce curves to a folder of measured operator "
                                      "times (the layout of hetserve/data/gpu-profiles).")
    fit.add_argument("--profiles", required=True, help="profile folder (compute/<gpu>/<org>/<model>/mlp.csv, "
                     "network/<setting>/all_reduce.csv)")
    fit.add_argument("-o", "--output", required=True, help="kernel-cost file to write (JSON)")
    fit.set_defaults(func=run_fit)


def run_layer(args: argparse.Namespace) -> int:
    from hetserve.cost.kernel_pricing import describe_source, layer_rows
    from hetserve.cost.kernel_table import default_table, load_table
    from hetserve.specs.gpus import gpu
    from hetserve.specs.model import load_model

    g = gpu(args.gpu, "--gpu", "gpu")
    model = load_model(args.model)
    table = load_table(args.table) if args.table else default_table()
    for tp in args.tp:  # the shards the planner, validator and runtime would refuse are not priced either
        why = model.tp_problem(tp)
        if why:
            raise SpecError("--tp", "tp", f"TP degrees that divide {model.name}'s heads, KV heads and FFN width", why)
    rows, source = layer_rows(g, model, args.tp, args.tokens, table)
    span = table.profiled_tokens(g.name)
    past = f"; tokens outside the profiled {span[0]:,}–{span[1]:,} are extrapolated" if span and any(
        r["extrapolated"] for r in rows) else ""
    note = f"{g.name}: {describe_source(source)}{past}; all-reduce: " + (
        f"fitted on {table.record.get('allreduce', {}).get('reference_gpu', '?')} in-box all-reduces, "
        f"scaled to {g.name}'s default in-box link" if table.allreduce else "no all-reduce fit in the table")
    if args.json:
        print(json.dumps(rows))
        print(note, file=sys.stderr)
        return 0
    print(f"{model.name} on {g.name} — one layer on one TP rank ({note})")
    print(f"{'tp':>3} {'tokens':>7} {'linear_ms':>10} {'layer_ms':>10} {'allreduce_ms':>13}  source")
    for r in rows:
        ar = "-" if r["allreduce_s"] is None else f"{r['allreduce_s'] * 1e3:13.4f}"
        how = f"{r['source']}, extrapolated" if r["extrapolated"] else r["source"]
        print(f"{r['tp']:>3} {r['tokens']:>7} {r['linear_s'] * 1e3:10.4f} {r['layer_s'] * 1e3:10.4f} {ar:>13}  {how}")
    return 0


def run_fit(args: argparse.Namespace) -> int:
    from hetserve.output_path import check_output_file
    from hetserve.cost.kernel_table import fit_table, save_table

    check_output_file(args.output, "-o")
    table = fit_table(args.profiles, command=f"hetserve cost fit --profiles {args.profiles} -o {args.output}")
    save_table(table, args.output)
    for name, entry in table.record["gpus"].items():
        lay, lin = entry["fit"]["layer"], entry["fit"]["linear"]
        print(f"{name}: fitted on {lay['points']} rows; layer within ±10 %: {lay['share_within']:.1%}; "
              f"linear within ±15 %: {lin['share_within']:.1%}")
    print("transfer rule: geometric mean of " + ", ".join(table.record["transfer"]["from"]))
    for f in table.record.get("allreduce", {}).get("fits", []):
        s = f["fit"]["from_64KiB"]
        print(f"all-reduce over {f['workers']}: within ±20 % from 64 KiB: {s['share_within']:.1%} of {s['points']}")
    print(f"wrote {args.output}")
    return 0
