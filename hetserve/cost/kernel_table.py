"""The fitted kernel-cost file: per-GPU parameters, the transfer rule's, the all-reduce fits, and
where every number came from.

``hetserve cost fit --profiles DIR -o FILE`` writes it (``fit_table`` + ``save_table``); the bundled
``hetserve/data/kernel-costs.json`` is that command's output on ``hetserve/data/gpu-profiles``. Layout::

    {"format": "hetserve-kernel-costs/1",
     "command": "hetserve cost fit --profiles gpu-profiles -o ...",
     "units": {...},
     "gpus": {"A100-SXM-80G": {"source": "fitted", "params": {...},
                               "profiles": [{"file": "compute/a100/...", "rows": 1044, "sha256": "..."}],
                               "fit": {"layer_within_10pct": ..., ...}}, ...},
     "transfer": {"source": "transfer rule: ...", "from": ["A100-SXM-80G", "A40"], "params": {...}},
     "allreduce": {"reference_gpu": "A100-SXM-80G", "link_bytes_per_s": 3e11,
                   "fits": [{"workers": 2, "alpha_s": ..., "efficiency": [...], "size_knots_log2": [...],
                             "profiles": [...], "fit": {...}}, ...]}}

A GPU of the catalog with an entry under ``gpus`` is priced from its own measurements; every
other GPU from ``transfer`` applied to its datasheet peaks. ``load_table`` refuses a malformed
file naming the file, the field and what was expected.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from hetserve.cost.collectives import KNOTS_LOG2, MIN_FIT_BYTES, AllReduceFit, fit_allreduce, nearest_fit
from hetserve.cost.kernels import PARAM_NAMES, KernelParams
from hetserve.cost.profiles import PROFILE_GPUS, read_allreduce, read_compute
from hetserve.errors import SpecError
from hetserve.specs.gpus import gpu as catalog_gpu

FORMAT = "hetserve-kernel-costs/1"
FITTED, TRANSFERRED, ROOFLINE = "fitted", "transferred", "roofline"
SOURCE_WORDS = {FITTED: "fitted from measurements of this GPU",
                TRANSFERRED: "transferred from the profiled GPUs (no measurements of this GPU)",
                ROOFLINE: "roofline (datasheet peaks x Efficiency)"}
# The profile setting whose all-reduces are fitted: one NVSwitch box, every group inside it.
ALLREDUCE_SETTING = "a100_dgx"
ALLREDUCE_GPU = "A100-SXM-80G"
UNITS = {"*_floor_s": "seconds", "gemm_memory, *_memory": "fraction of the datasheet memory bandwidth",
         "gemm_compute": "fraction of the datasheet dense FP16 FLOP/s", "gemm_sharpness": "exponent",
         "gemm_tile_waste": "share of a row tile's padding paid", "alpha_s": "seconds",
         "efficiency": "fraction of link_bytes_per_s at each size_knots_log2 (log2 bytes)"}


@dataclass(frozen=True)
class KernelTable:
    """Fitted per-GPU parameters, the transfer rule's, the all-reduce fits, and the file's record."""

    fitted: dict[str, KernelParams]
    transferred: KernelParams
    allreduce: dict[int, AllReduceFit]
    link_bytes_per_s: float  # the link bandwidth the all-reduce fits were measured over
    record: dict = field(default_factory=dict, compare=False)  # the file as written (provenance)

    def params_for(self, gpu_name: str) -> tuple[KernelParams, str]:
        """(parameters, ``FITTED`` or ``TRANSFERRED``) for a catalog GPU."""
        if gpu_name in self.fitted:
            return self.fitted[gpu_name], FITTED
        return self.transferred, TRANSFERRED

    def profiled_tokens(self, gpu_name: str) -> tuple[int, int] | None:
        """(fewest, most) tokens per step in the profiles behind ``gpu_name``'s parameters (a
        transferred GPU's: every fitted GPU's), or None where the file does not record them."""
        ranges = [e.get("tokens") for name, e in self.record.get("gpus", {}).items()
                  if name == gpu_name or gpu_name not in self.fitted]
        if not ranges or any(r is None for r in ranges):
            return None
        return min(r[0] for r in ranges), max(r[1] for r in ranges)

    def allreduce_time(self, workers: int, nbytes: float, link_bandwidth: float) -> float:
        """One all-reduce of ``nbytes`` over ``workers`` GPUs in one box joined by ``link_bandwidth``."""
        if workers <= 1 or nbytes <= 0:
            return 0.0
        return nearest_fit(self.allreduce, workers).time(nbytes, link_bandwidth, workers)


def _file_record(path: Path, root: Path, rows: int) -> dict:
    return {"file": str(path.relative_to(root)), "rows": rows,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def fit_table(folder: str | Path, command: str = "") -> KernelTable:
    """Fit every profiled GPU, the transfer rule and the all-reduces of a profile folder."""
    from hetserve.cost.kernel_fit import errors, fit_gpu, summary, transfer  # scipy: only when fitting

    root = Path(folder)
    points = read_compute(root)
    by_gpu: dict[str, list] = {}
    for p in points:
        by_gpu.setdefault(p.gpu, []).append(p)
    fitted, gpus = {}, {}
    folder_of = {v: k for k, v in PROFILE_GPUS.items()}
    for name, pts in sorted(by_gpu.items()):
        g = catalog_gpu(name)
        fitted[name] = fit_gpu(pts, g)
        err = errors(fitted[name], g, pts)
        files = sorted((root / "compute" / folder_of[name]).rglob("mlp.csv"))
        gpus[name] = {"source": FITTED, "params": fitted[name].as_dict(),
                      "datasheet": {"fp16_flops": g.fp16_flops, "mem_bandwidth_bytes_per_s": g.mem_bandwidth},
                      "profiles": [_file_record(f, root, sum(1 for _ in f.open()) - 1) for f in files],
                      "tokens": [min(p.tokens for p in pts), max(p.tokens for p in pts)],  # the profiled range
                      "fit": {"layer": summary(err["layer"], 0.10), "linear": summary(err["linear"], 0.15)}}
    rule = transfer(list(fitted.values()))
    record = {"format": FORMAT, "command": command, "units": UNITS, "gpus": gpus,
              "transfer": {"source": "transfer rule: each parameter the geometric mean of the fitted GPUs' "
                                     "(fractions of the datasheet peaks and floors in seconds carry; "
                                     "docs/cost-model.md)",
                           "from": sorted(fitted), "params": rule.as_dict()}}
    link = _reference_link()
    ar_points = [p for p in read_allreduce(root) if p.setting == ALLREDUCE_SETTING and p.workers == p.per_node]
    fits = {}
    ar_records = []
    for w in sorted({p.workers for p in ar_points}):
        sel = [p for p in ar_points if p.workers == w]
        fits[w] = fit_allreduce(sel, w, link)
        ratio = np.array([fits[w].time(p.size, link) / p.seconds for p in sel if p.size >= MIN_FIT_BYTES])
        path = root / "network" / ALLREDUCE_SETTING / "all_reduce.csv"
        ar_records.append({**fits[w].as_dict(), "profiles": [_file_record(path, root, len(sel))],
                           "fit": {"from_64KiB": summary(ratio, 0.20)}})
    if fits:
        record["allreduce"] = {"setting": ALLREDUCE_SETTING, "reference_gpu": ALLREDUCE_GPU,
                               "link_bytes_per_s": link, "fits": ar_records}
    return KernelTable(fitted, rule, fits, link, record)


def _reference_link() -> float:
    """The link bandwidth of the profiled all-reduce box: the cluster default for its GPU."""
    from hetserve.specs.cluster import GBPS, default_intra_link
    return default_intra_link(catalog_gpu(ALLREDUCE_GPU))[0] * GBPS


def save_table(table: KernelTable, path: str | Path) -> None:
    Path(path).write_text(json.dumps(table.record, indent=1) + "\n")


def _need(src: str, data: dict, key: str, kind, where: str):
    if not isinstance(data, dict) or key not in data:
        raise SpecError(src, where + key, "present")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise SpecError(src, where + key, {dict: "a mapping", list: "a list", str: "a string"}.get(kind, "a number"),
                        value)
    return value


def _params(src: str, data: dict, where: str) -> KernelParams:
    raw = _need(src, data, "params", dict, where)
    for name in PARAM_NAMES:
        _need(src, raw, name, (int, float), where + "params.")
    unknown = set(raw) - set(PARAM_NAMES)
    if unknown:
        raise SpecError(src, where + "params." + sorted(unknown)[0], "one of " + ", ".join(PARAM_NAMES))
    try:
        return KernelParams.of(raw)
    except ValueError as exc:
        raise SpecError(src, where + "params", "values in range", str(exc)) from exc


def table_from_record(record: dict, src: str = "(kernel costs)") -> KernelTable:
    """Rebuild a table from its file's contents, checking every field."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise SpecError(src, "format", repr(FORMAT), record.get("format") if isinstance(record, dict) else record)
    fitted = {}
    for name, entry in _need(src, record, "gpus", dict, "").items():
        catalog_gpu(name, src, f"gpus.{name}")
        fitted[name] = _params(src, entry, f"gpus.{name}.")
    rule = _params(src, _need(src, record, "transfer", dict, ""), "transfer.")
    fits, link = {}, 1.0
    if "allreduce" in record:
        ar = _need(src, record, "allreduce", dict, "")
        link = float(_need(src, ar, "link_bytes_per_s", (int, float), "allreduce."))
        for i, f in enumerate(_need(src, ar, "fits", list, "allreduce.")):
            where = f"allreduce.fits.{i}."
            if list(_need(src, f, "size_knots_log2", list, where)) != list(KNOTS_LOG2):
                raise SpecError(src, where + "size_knots_log2", str(list(KNOTS_LOG2)), f["size_knots_log2"])
            try:
                fit = AllReduceFit(int(_need(src, f, "workers", (int, float), where)),
                                   float(_need(src, f, "alpha_s", (int, float), where)),
                                   tuple(float(e) for e in _need(src, f, "efficiency", list, where)))
            except (TypeError, ValueError) as exc:
                raise SpecError(src, where.rstrip("."), "a valid all-reduce fit", str(exc)) from exc
            fits[fit.workers] = fit
    return KernelTable(fitted, rule, fits, link, record)


def load_table(path: str | Path) -> KernelTable:
    """Read a kernel-cost file (``hetserve cost fit -o``)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(str(path), "(file)", "a readable JSON kernel-cost file", str(exc)) from exc
    return table_from_record(record, str(path))


@lru_cache(maxsize=1)
def default_table() -> KernelTable:
    """The bundled table (``hetserve/data/kernel-costs.json``)."""
    with resources.as_file(resources.files("hetserve") / "data" / "kernel-costs.json") as p:
        return load_table(p)
