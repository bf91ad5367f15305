"""Measured GPU operator times read from a profile folder (Vidur's layout, ``hetserve/data/gpu-profiles``).

A folder holds ``compute/<gpu>/<org>/<model>/mlp.csv`` (one row per token count and TP degree: the
model's shape and, per operator of one layer on one TP rank, ``time_stats.<op>.median`` in
milliseconds) and ``network/<setting>/all_reduce.csv`` (``size`` in bytes, ``num_workers``,
``devices_per_node``, ``time_stats.all_reduce.median`` in milliseconds). Times come back in seconds.

Every cell this module reads is checked: a missing column or a cell that is not a number raises
``SpecError`` naming the file, the row (1 = the header) and the column.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from hetserve.errors import SpecError

# The operators of one layer the profiles time, in the order a layer runs them.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# A parallel attention + MLP block (Phi-2) has one norm: its profile has no such column.
OPTIONAL_OPS = ("post_attention_layernorm",)
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "num_tokens", "num_tensor_parallel_workers")
ALLREDUCE_COLUMNS = ("size", "num_workers", "devices_per_node", "time_stats.all_reduce.median")
MS = 1e-3
# The profiles bundled with the package (the columns this module reads): what the bundled fit was made on.
BUNDLED_PROFILES = Path(__file__).resolve().parents[1] / "data" / "gpu-profiles"

# Profile folder names -> the GPU catalog's names (``data/gpus.csv``).
PROFILE_GPUS = {"a100": "A100-SXM-80G", "a40": "A40"}


@dataclass(frozen=True)
class LayerShape:
    """One layer's shape as the profiles state it (``n_embd`` = hidden, ``n_expanded_embd`` = FFN)."""

    heads: int
    kv_heads: int
    hidden: int
    ffn: int
    gated: bool
    head_dim: int

    @staticmethod
    def of_model(model) -> "LayerShape":
        """From a ``ModelSpec``."""
        return LayerShape(model.num_heads, model.num_kv_heads, model.hidden, model.ffn_hidden, model.gated_ffn,
                          model.dim_head)


@dataclass(frozen=True)
class OpPoint:
    """One measured row: a model's layer at ``tokens`` tokens on one rank of TP ``tp``; ``times`` in
    seconds per operator (``LAYER_OPS``; ``OPTIONAL_OPS`` only where measured)."""

    gpu: str  # catalog name
    model: str  # "<org>/<model>" as the folder names it
    shape: LayerShape
    tp: int
    tokens: int
    times: dict[str, float]


@dataclass(frozen=True)
class CollectivePoint:
    """One measured all-reduce: ``size`` bytes over ``workers`` ranks, ``per_node`` of them in one box."""

    setting: str
    size: float
    workers: int
    per_node: int
    seconds: float


def _rows(path: Path, required: tuple[str, ...]):
    """(row number, row) of a CSV file whose header holds every ``required`` column."""
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise SpecError(str(path), "(file)", "a readable CSV file", str(exc)) from exc
    with fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        for col in required:
            if col not in header:
                raise SpecError(f"{path}:1", col, "a column of that name in the header")
        for i, row in enumerate(reader):
            yield i + 2, row


def _number(path: Path, line: int, row: dict, col: str) -> float:
    text = row.get(col)
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise SpecError(f"{path}:{line}", col, "a number", text) from None
    if not math.isfinite(value) or value < 0:
        raise SpecError(f"{path}:{line}", col, "a finite non-negative number", text)
    return value


def _flag(path: Path, line: int, row: dict, col: str) -> bool:
    text = (row.get(col) or "").strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise SpecError(f"{path}:{line}", col, "True or False", row.get(col))
    return text in ("true", "1")


def read_mlp_csv(path: str | Path, gpu: str, model: str) -> list[OpPoint]:
    """The rows of one ``mlp.csv``; duplicate (tokens, TP) rows are averaged into one point."""
    path = Path(path)
    with path.open(newline="") as fh:
        header = next(csv.reader(fh), [])
    ops = tuple(op for op in LAYER_OPS if op not in OPTIONAL_OPS or f"time_stats.{op}.median" in header)
    op_cols = tuple(f"time_stats.{op}.median" for op in ops)
    seen: dict[tuple[int, int], list] = {}
    shape = None
    for line, row in _rows(path, SHAPE_COLUMNS + ("use_gated_mlp",) + op_cols):
        n = {c: _number(path, line, row, c) for c in SHAPE_COLUMNS}
        times = {op: _number(path, line, row, c) * MS for op, c in zip(ops, op_cols)}
        heads = int(n["n_head"])
        if heads <= 0 or int(n["n_embd"]) % heads:
            raise SpecError(f"{path}:{line}", "n_head", "a positive divisor of n_embd", row.get("n_head"))
        shape = LayerShape(heads, int(n["n_kv_head"]), int(n["n_embd"]), int(n["n_expanded_embd"]),
                           _flag(path, line, row, "use_gated_mlp"), int(n["n_embd"]) // heads)
        key = (int(n["num_tokens"]), int(n["num_tensor_parallel_workers"]))
        seen.setdefault(key, []).append(times)
    if shape is None:
        raise SpecError(str(path), "(rows)", "at least one measured row")
    return [OpPoint(gpu, model, shape, tp, tokens, {op: sum(t[op] for t in ts) / len(ts) for op in ops})
            for (tokens, tp), ts in sorted(seen.items())]


def read_compute(folder: str | Path) -> list[OpPoint]:
    """Every ``compute/<gpu>/**/mlp.csv`` under a profile folder, GPUs named as in the catalog."""
    root = Path(folder) / "compute"
    if not root.is_dir():
        raise SpecError(str(folder), "compute/", "a profile folder holding compute/<gpu>/<org>/<model>/mlp.csv")
    points: list[OpPoint] = []
    for gpu_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        gpu = PROFILE_GPUS.get(gpu_dir.name)
        if gpu is None:
            raise SpecError(str(gpu_dir), "(folder name)", "one of " + ", ".join(PROFILE_GPUS), gpu_dir.name)
        for csv_path in sorted(gpu_dir.rglob("mlp.csv")):
            points += read_mlp_csv(csv_path, gpu, str(csv_path.parent.relative_to(gpu_dir)))
    if not points:
        raise SpecError(str(root), "(files)", "at least one compute/<gpu>/<org>/<model>/mlp.csv")
    return points


def read_allreduce(folder: str | Path) -> list[CollectivePoint]:
    """Every ``network/<setting>/all_reduce.csv`` under a profile folder (none: an empty list)."""
    points: list[CollectivePoint] = []
    for path in sorted((Path(folder) / "network").glob("*/all_reduce.csv")):
        for line, row in _rows(path, ALLREDUCE_COLUMNS):
            n = {c: _number(path, line, row, c) for c in ALLREDUCE_COLUMNS}
            points.append(CollectivePoint(path.parent.name, n["size"], int(n["num_workers"]),
                                          int(n["devices_per_node"]), n["time_stats.all_reduce.median"] * MS))
    return points
