"""``hetserve make-model``: write a random-weight HF checkpoint with a byte tokenizer (tests, demos
and, with ``--random-weights``, real shapes without a weights file)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetserve.errors import SpecError

MAX_PARAMS = 2 ** 30  # 4 GiB of float32 weights
# the shape options, their defaults (a tiny model) and the ModelSpec field each takes with --like
SHAPE = {"layers": (4, "num_layers"), "hidden": (64, "hidden"), "heads": (4, "num_heads"),
         "kv_heads": (None, "num_kv_heads"), "ffn": (None, "ffn_hidden"), "vocab": (320, "vocab"),
         "max_positions": (1024, "max_context")}
# the dtype each preset's published config.json names (torch_dtype): --like writes it, so the folder
# is sized (describe, plan) and served in the preset's dtype, not float32. A preset not listed is
# sized at 2 bytes per parameter: float16.
PRESET_DTYPES = {"llama-2-7b": "float16", "llama-2-13b": "float16", "llama-2-70b": "float16",
                 "llama-30b": "float16", "opt-30b": "float16", "qwen-7b": "bfloat16", "qwen2-7b": "bfloat16"}
DTYPES = ("float32", "float16", "bfloat16")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model", help="write a random-weight Llama/OPT checkpoint (tests, demos, real shapes)",
        description="Write a random-weight checkpoint in the Hugging Face layout (safetensors) with "
                    "a byte-level tokenizer that needs no download. With --random-weights, no weights "
                    "file: each worker draws its stage on its device at start-up, so a real shape "
                    "(--like llama-2-7b) is served from a folder of a few kilobytes.")
    p.add_argument("--arch", choices=("llama", "opt"), default=None, help="architecture (default llama)")
    p.add_argument("--like", metavar="PRESET", help="take the shape of a model preset (e.g. llama-2-7b); "
                   "the shape options below override its fields")
    p.add_argument("--layers", type=int, help="transformer layers (default 4)")
    p.add_argument("--hidden", type=int, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, help="attention heads (default 4)")
    p.add_argument("--kv-heads", type=int, help="key/value heads, Llama GQA (default: heads)")
    p.add_argument("--ffn", type=int, help="FFN size (default 2*hidden Llama, 4*hidden OPT)")
    p.add_argument("--vocab", type=int, help="vocabulary size, >= 259 (default 320)")
    p.add_argument("--max-positions", type=int, help="context length (default 1024)")
    p.add_argument("--dtype", choices=DTYPES, help="the weights' dtype, written to config.json (default: the "
                   "preset's with --like, e.g. float16 for llama-2-7b; else float32)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--random-weights", action="store_true",
                   help="write no weights: workers draw them on their device from the seed (any size)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.set_defaults(func=_run)


def _shape(args: argparse.Namespace) -> dict[str, str]:
    """Fill the shape options left unset: from ``--like``'s preset, else the tiny defaults. Returns
    where each came from ("given", "from --like PRESET" or "the default"), for the errors."""
    preset = None
    origin = {"arch": "given" if args.arch is not None else f"from --like {args.like}" if args.like else "the default"}
    if args.like:
        from hetserve.specs.model import load_model

        preset = load_model(args.like)  # a SpecError naming --like's value and the presets otherwise
        args.arch = args.arch or preset.arch
        args.dtype = args.dtype or PRESET_DTYPES.get(args.like, "float16")
    args.arch = args.arch or "llama"
    for option, (default, field) in SHAPE.items():
        origin[option] = "given" if getattr(args, option) is not None else (
            f"from --like {args.like}" if preset is not None else "the default")
        if origin[option] == "given":
            continue
        # OPT has no grouped-query attention: a Llama preset's KV heads do not carry over to it
        setattr(args, option, None if option == "kv_heads" and args.arch == "opt" else
                getattr(preset, field) if preset is not None else default)
    return origin


def _shape_refusal(args: argparse.Namespace, origin: dict[str, str], exc) -> SpecError:
    """``make_model``'s ``ShapeError`` as one line naming the option the user gave (and where the other
    value came from: --like's preset or the default)."""
    def flag(field: str) -> str:
        return "--" + field.replace("_", "-")

    def value(field: str):
        return args.heads if field == "kv_heads" and args.kv_heads is None else getattr(args, field)

    if exc.fields == ("arch",) and origin.get("arch") != "given":  # --like a preset of another family (Qwen)
        from hetserve.runtime.model.make import ARCHS

        writes = ", ".join(ARCHS)
        return SpecError("--like", SpecError.OPTION, f"a preset of an architecture make-model writes ({writes}), or "
                         f"--arch beside it (--arch llama: a Llama of the {args.arch} preset's shape)", args.like)
    given = [f for f in exc.fields if origin.get(f) == "given"]
    subject = (given or list(exc.fields))[0]
    if len(exc.fields) == 1:
        return SpecError(flag(subject), SpecError.OPTION, exc.expected, value(subject))
    multiple, divisor = exc.fields
    other = divisor if subject == multiple else multiple
    if origin.get(other) == "given":
        ref = f"{flag(other)} ({value(other)})"
    else:
        ref = f"the {_NOUNS[other]} ({value(other)}, {origin[other]}; pass {flag(other)})"
    relation = "a multiple of" if subject == multiple else "a divisor of"
    return SpecError(flag(subject), SpecError.OPTION, f"{relation} {ref}", value(subject))


_NOUNS = {"hidden": "hidden size", "heads": "heads", "kv_heads": "KV heads"}


def _run(args: argparse.Namespace) -> int:
    from hetserve.runtime.model.make import ShapeError, check_shape, make_model

    from hetserve.output_path import check_output_folder

    check_output_folder(args.output, "-o")  # before torch is loaded and the weights made
    out_dir = Path(args.output)
    if out_dir.is_dir() and any(out_dir.iterdir()):  # never write random weights over a real checkpoint
        raise SpecError(args.output, "-o", "a new or empty folder", "a folder holding " +
                        ", ".join(sorted(p.name for p in out_dir.iterdir())[:3]))
    origin = _shape(args)
    try:
        check_shape(args.arch, args.hidden, args.heads, args.kv_heads, args.vocab)
    except ShapeError as exc:
        raise _shape_refusal(args, origin, exc) from exc
    params = _num_params(args)
    if params > MAX_PARAMS and not args.random_weights:  # the weights are made in memory before they are written
        raise SpecError("--layers/--hidden/--ffn/--vocab/--max-positions", "(options)",
                        f"a checkpoint of at most {MAX_PARAMS:.2g} parameters (make-model writes small random-weight "
                        f"models for tests and demos; --random-weights writes any size, no weights file)",
                        f"about {params:.3g} parameters")
    try:
        out = make_model(args.output, args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
                         max_positions=args.max_positions, seed=args.seed, random_weights=args.random_weights,
                         dtype=args.dtype)
    except ValueError as exc:  # the shape passed check_shape: what transformers refused besides
        raise SpecError("make-model", SpecError.OPTION, "a model shape transformers builds", str(exc)) from exc
    what = "recipe (random weights drawn by each worker)" if args.random_weights else "checkpoint"
    print(f"wrote {args.arch} {what} ({args.layers} layers, hidden {args.hidden}, about {params:.3g} parameters, "
          f"{args.dtype or 'float32'}) "
          f"to {out}")
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
