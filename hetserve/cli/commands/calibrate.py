"""``hetserve calibrate``: fit the cost model's efficiency (and the serving overheads) to this machine."""

from __future__ import annotations

import argparse


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


# --no-NAME: skip a group of probes, and what the fit does without it
SKIPS = {
    "pipeline": "the two-stage pipeline probes (the per-stage fixed cost is then not told apart from the "
                "per-iteration one)",
    "tp": "the TP 2 probes (the collectives' fixed cost is then 0)",
    "handoff": "the KV hand-off probe (prefill slot -> decode slot; its overhead is then 0)",
    "long-decode": "the decode batch from 256-token prompts (a decode step's attention over its context is then "
                   "priced at the prompts' attention efficiency)",
    "speed-probe": "the machine's speed probe in each round (`hetserve compare` then prices at the calibration's "
                   "speed)",
    "serving": "the HTTP probes: engine only (no request overhead measured)",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure the engine here and fit the cost model's efficiency",
                       description="Serve the model on one device, measure prefill and decode times on the engine "
                                   "and TTFT through HTTP, and fit the cost model's compute and memory efficiency, "
                                   "per-iteration overhead and the per-request serving overhead to them.")
    p.add_argument("--model", help="checkpoint folder (see `hetserve make-model`); needed unless --profiles")
    p.add_argument("--profiles", metavar="DIR", help="instead of measuring here: fit the kernel cost model to a folder "
                   "of measured GPU operator times, written to -o (the same as `hetserve cost fit`)")
    p.add_argument("--gpu", default=PROBE_DEFAULTS["gpu"], help="GPU type the efficiency is relative to (default RTX-4090)")
    p.add_argument("--prompt-lengths", type=_sizes, default=PROBE_DEFAULTS["prompt_lengths"], metavar="L1,L2,...",
                   help="prefill probes, prompt tokens (default 32,128,256,512)")
    p.add_argument("--batch-sizes", type=_sizes, default=PROBE_DEFAULTS["batch_sizes"], metavar="B1,B2,...",
                   help="decode probes, requests at once (default 1,4,16)")
    p.add_argument("--decode-tokens", type=_positive, default=PROBE_DEFAULTS["decode_tokens"], help="tokens per decode probe (default 24)")
    p.add_argument("--reps", type=_positive, default=PROBE_DEFAULTS["reps"],
                   help="rounds over every probe (median per probe; default 7: the load of a shared machine drifts)")
    for name, what in SKIPS.items():
        p.add_argument(f"--no-{name}", action="store_true", help=f"skip {what}")
    p.add_argument("-o", "--output", help="write the calibration JSON here (for `plan/simulate --efficiency`)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none off a terminal either)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hetserve.calibration.calibrate import calibrate
    from hetserve.calibration.speed_probe import PROMPT_TOKENS
    from hetserve.specs.gpus import gpu

    from hetserve.cli.model_dir import check_model_dir
    from hetserve.cli.progress import phase_progress, stop_on_sigterm
    from hetserve.output_path import check_distinct, check_output_file

    if args.profiles:
        from hetserve.cli.commands.cost import run_fit
        from hetserve.errors import SpecError

        named = probe_options(args)
        if named:  # a fit of measured files runs no probe: these would be dropped unseen
            raise SpecError("--profiles", SpecError.OPTION, "no probe options beside it (it fits the kernel costs to the "
                            "measured files and runs nothing); drop " + ", ".join(named), " ".join(named))
        if not args.output:
            raise SpecError("(command line)", "--output", "a file for the fitted kernel costs (with --profiles)")
        return run_fit(args)
    if not args.model:
        from hetserve.errors import SpecError

        raise SpecError("(command line)", "--model", "a checkpoint folder (or --profiles DIR)")
    gpu(args.gpu, "--gpu")  # a clear error before any process starts
    check_model_dir(args.model)  # a folder, never a hub name looked up online
    if tuple(args.prompt_lengths) != PROBE_DEFAULTS["prompt_lengths"]:
        from hetserve.errors import SpecError
        from hetserve.specs.model import load_model

        spec = load_model(args.model)
        if max(args.prompt_lengths) + args.decode_tokens > spec.max_context:
            raise SpecError("--prompt-lengths", SpecError.OPTION, f"prompts that leave {args.decode_tokens} decode tokens "
                            f"within {args.model}'s context of {spec.max_context} tokens",
                            ",".join(map(str, args.prompt_lengths)))
    if args.output:
        check_output_file(args.output, "--output")
        # not one of the checkpoint's own files: its config.json, tokenizer or weights would be
        # replaced by the calibration minutes later, the checkpoint lost
        from pathlib import Path

        check_distinct({"--output": args.output},
                       {f"--model ({f.name})": str(f) for f in sorted(Path(args.model).iterdir()) if f.is_file()})
    console = Console()
    with stop_on_sigterm(), phase_progress(console, args.quiet) as progress:
        cal = calibrate(args.model, args.gpu, prompt_lengths=args.prompt_lengths, batch_sizes=args.batch_sizes,
                        decode_tokens=args.decode_tokens, reps=args.reps, serving=not args.no_serving,
                        pipeline=not args.no_pipeline, tp=not args.no_tp, handoff=not args.no_handoff,
                        long_decode=not args.no_long_decode, speed=not args.no_speed_probe, progress=progress)
    on = cal.measured_on
    t = Table("phase", "size", "context", "stages", "tp", "measured ms", "cost model ms", "error",
              title=f"calibration of {args.model} against {args.gpu} (measured on {on.get('device', '?')}, {on.get('cores', '?')} "
                    f"cores, {on.get('date', '?')}, load avg {on.get('load_avg_1m', '?')})")
    for p in cal.points:
        t.add_row(p.phase, str(p.size), f"{p.prompt}+" if p.phase == "decode" else "-", str(p.stages), str(p.tp), f"{p.measured_s * 1e3:.2f}", f"{p.predicted_s * 1e3:.2f}", f"{p.error:+.0%}")
    console.print(t)
    eff = cal.efficiency
    console.print(f"compute efficiency {eff.compute:.3g}, attention {_attention(eff, args)}, memory efficiency "
                  f"{eff.memory:.3g}{'' if cal.memory_bound else ' (the default: no decode probe is bandwidth-bound)'}"
                  f", fixed costs "
                  f"{eff.iteration_overhead_s * 1e3:.2f} ms per iteration (scheduler turn-around, sampling) + "
                  f"{eff.step_overhead_s * 1e3:.2f} ms per stage (step message, attention metadata, hand-on; "
                  f"{'from the two-stage probes' if any(p.stages > 1 for p in cal.points) else 'not separated: no pipeline probe'}"
                  f"{_turn_hold(eff)}) + {eff.prompt_step_overhead_s * 1e3:.2f} ms per stage of a step carrying a "
                  f"prompt (its causal mask and padded query grid; from the prompt lengths against the decodes) + "
                  f"{eff.seq_overhead_s * 1e3:.3f} ms per sequence (bookkeeping, its attention, token streamed; "
                  f"from the decode batch sizes) + {_collectives(cal, args)}, matrix products of more than one row (GEMM, "
                  f"not matrix-vector) "
                  f"{eff.multi_row_s_per_byte * 1e9:.3f} ms per MB of a device's weights (from the one-sequence "
                  f"decode against the larger ones), "
                  f"request overhead (HTTP, "
                  f"tokenisation, SSE) {cal.request_overhead_s * 1e3:.2f} ms, stream overhead (each token over "
                  f"HTTP/SSE, served − engine TPOT) {cal.stream_step_overhead_s * 1e3:.2f} ms per step + "
                  f"{cal.stream_overhead_s * 1e3:.3f} ms per sequence, KV hand-off "
                  f"overhead (beyond the link's α-β) {cal.kv_handoff_overhead_s * 1e3:.2f} ms, slow-down beside one more busy "
                  f"process {cal.contention_slowdown:.2f}x, front end's CPU (server, coordinator, client) "
                  f"{cal.frontend_request_cpu_s * 1e3:.2f} ms per request + {cal.frontend_step_cpu_s * 1e3:.3f} ms per "
                  f"engine step + {cal.frontend_token_cpu_s * 1e3:.3f} ms per token, a step's wait for the front "
                  f"end's GIL {cal.frontend_dispatch_s * 1e3:.2f} ms per unit of its utilisation by other work (the "
                  f"GIL probe); fit error per point: mean "
                  f"{cal.mean_abs_error:.0%}, worst {cal.max_abs_error:.0%}")
    if cal.speed_probe:
        sp = cal.speed_probe
        console.print(f"machine speed probe (runtime.speed_probe; `hetserve compare` reads it again when it serves): "
                      f"one-token decode {sp.decode_s * 1e3:.2f} ms, {PROMPT_TOKENS}-token prompt "
                      f"{sp.prefill_s * 1e3:.1f} ms (median over the rounds)")
    if cal.frontend_points:
        f = Table("requests", "engine steps", "tokens", "measured CPU ms", "fitted ms", "error",
                  title="the front end's CPU (HTTP/SSE server, coordinator, client: this process) per HTTP probe")
        for p in cal.frontend_points:
            f.add_row(str(p.requests), str(p.steps), str(p.tokens), f"{p.measured_s * 1e3:.1f}",
                      f"{p.predicted_s * 1e3:.1f}", f"{p.error:+.0%}")
        console.print(f)
    if args.output:
        cal.save(args.output)
        console.print(f"wrote {args.output}")
    return 0


# the probe options' defaults: with --profiles, any other value was named by the user and cannot act
PROBE_DEFAULTS = {"model": None, "gpu": "RTX-4090", "prompt_lengths": (32, 128, 256, 512), "batch_sizes": (1, 4, 16),
                  "decode_tokens": 24, "reps": 7, "no_pipeline": False, "no_tp": False, "no_handoff": False,
                  "no_long_decode": False, "no_speed_probe": False, "no_serving": False, "quiet": False}


def probe_options(args: argparse.Namespace) -> list[str]:
    """The probe options ``args`` sets away from their defaults, as the user spelt them."""
    return ["--" + k.replace("_", "-") for k, v in PROBE_DEFAULTS.items()
            if (tuple(getattr(args, k)) if isinstance(v, tuple) else getattr(args, k)) != v]


def _attention(eff, args) -> str:
    """Attention's efficiencies as fitted, or what they are taken as where no probe measured them
    (``Efficiency``: 0 means "the same as compute" / "the same as prompts", not a zero rate)."""
    prompts = (f"{eff.attention:.3g} (prompts)" if eff.attention else "as compute (prompts; not fitted: it needs three "
               f"or more --prompt-lengths, {len(args.prompt_lengths)} given)")
    decode = (f"{eff.decode_attention:.3g} (a decode step over its context)" if eff.decode_attention else
              "as prompts (a decode step over its context; not fitted: " +
              ("--no-long-decode)" if args.no_long_decode else "no long-context probe)"))
    return f"{prompts}, {decode}"


def _turn_hold(eff) -> str:
    """The share of the turn-around that holds a pipeline's last stage, where the two-micro-batch probe measured it."""
    if eff.turn_hold is None:
        return ""
    return (f"; {eff.turn_hold:.0%} of the turn-around holds a pipeline's last stage while another micro-batch "
            "is in flight (from the two-stage decode of two)")


def _collectives(cal, args) -> str:
    """What the TP collectives cost, and where from (nothing measured without the TP 2 probes, and
    why there were none)."""
    if not any(p.tp > 1 for p in cal.points):
        from hetserve.calibration.probe_shapes import tp_divides
        from hetserve.specs.model import load_model

        spec = load_model(args.model)
        why = ("--no-tp" if args.no_tp else
               f"the checkpoint's {spec.num_heads} heads, {spec.num_kv_heads} KV heads and FFN of {spec.ffn_hidden} "
               "do not all split in two" if not tp_divides(spec, 2) else "no TP probe")
        return f"no TP collective cost (no TP 2 probe: {why})"
    eff = cal.efficiency
    return (f"{eff.collective_overhead_s * 1e3:.2f} ms per TP collective + {eff.collective_s_per_byte * 1e9:.2f} ms "
            f"per MB it carries (from the TP 2 prompt against the TP 2 decode)")
