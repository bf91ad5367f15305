"""``hetserve make-model``: write a tiny random-weight HF checkpoint with a byte tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path

MAX_PARAMS = 2 ** 30  # 4 GiB of float32 weights


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model", help="write a tiny random-weight Llama/OPT checkpoint (tests and demos)",
        description="Write a random-weight checkpoint in the Hugging Face layout (safetensors) with "
                    "a byte-level tokenizer that needs no download.")
    p.add_argument("--arch", choices=("llama", "opt"), default="llama")
    p.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, Llama GQA (default: heads)")
    p.add_argument("--ffn", type=int, default=None, help="FFN size (default 2*hidden Llama, 4*hidden OPT)")
    p.add_argument("--vocab", type=int, default=320, help="vocabulary size, >= 259 (default 320)")
    p.add_argument("--max-positions", type=int, default=1024, help="context length (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hetserve.errors import SpecError
    from hetserve.runtime.model.make import make_model

    from hetserve.cli.output_path import check_output_folder

    check_output_folder(args.output, "-o")  # before torch is loaded and the weights made
    out_dir = Path(args.output)
    if out_dir.is_dir() and any(out_dir.iterdir()):  # never write random weights over a real checkpoint
        raise SpecError(args.output, "-o", "a new or empty folder", "a folder holding " +
                        ", ".join(sorted(p.name for p in out_dir.iterdir())[:3]))
    params = _num_params(args)
    if params > MAX_PARAMS:  # the weights are made in memory before they are written
        raise SpecError("--layers/--hidden/--ffn/--vocab/--max-positions", "(options)",
                        f"a checkpoint of at most {MAX_PARAMS:.2g} parameters (make-model writes small random-weight "
                        f"models for tests and demos)", f"about {params:.3g} parameters")
    try:
        out = make_model(args.output, args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                         max_positions=args.max_positions, seed=args.seed)
    except ValueError as exc:
        raise SpecError("make-model", "arguments", "a consistent model shape", str(exc)) from exc
    print(f"wrote {args.arch} checkpoint ({args.layers} layers, hidden {args.hidden}) to {out}")
    return 0


def _num_params(args: argparse.Namespace) -> int:
    """Parameters of the checkpoint ``args`` ask for, by the cost model's count (0 for a shape
    ``make_model`` refuses: it says why)."""
    from hetserve.runtime.model.make import default_ffn
    from hetserve.specs.model import ModelSpec

    try:
        spec = ModelSpec("make-model", args.arch, args.layers, args.hidden, args.heads, args.kv_heads or args.heads,
                         args.ffn or default_ffn(args.arch, args.hidden), args.vocab, args.max_positions,
                         dtype_bytes=4)
    except ValueError:
        return 0
    return spec.num_params
