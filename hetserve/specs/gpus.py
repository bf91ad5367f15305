"""GPU catalog: one row per GPU type, read from the bundled ``data/gpus.csv``.

The table comes from ``shared/data/gpus.csv`` (see ``data/ATTRIBUTION.md`` for sources).
Unknown prices stay ``None``: a missing price is not a free GPU.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from hetserve.errors import SpecError

GB = 1e9  # decimal gigabyte, as the datasheets use


def fmt_gb(nbytes: float) -> str:
    """``nbytes`` as decimal GB for messages: whole GB where that is precise enough, else enough
    digits that a CPU worker slot's 0.3 GB (or a tiny model's 0.004 GB) does not print as "0 GB"."""
    gb = nbytes / GB
    return f"{gb:,.0f} GB" if gb >= 10 else f"{gb:.2g} GB"


@dataclass(frozen=True)
class GpuType:
    """One GPU model. Units: bytes, bytes/s, FLOP/s, USD/hour."""

    name: str
    memory_bytes: float
    mem_bandwidth: float  # bytes/s
    fp16_flops: float  # dense FP16 tensor FLOP/s
    nvlink: bool
    usd_per_hour: float | None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.mem_bandwidth <= 0 or self.fp16_flops <= 0:
            raise ValueError(f"GPU {self.name}: memory, bandwidth and FLOP/s must be positive")

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB


def _parse_row(row: dict[str, str], source: str, line: int) -> GpuType:
    def num(key: str) -> float:
        try:
            value = float(row[key])
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"{source}:{line}", key, "a number", row.get(key)) from exc
        return value

    price_text = (row.get("typical_cloud_usd_per_hour") or "").strip()
    price = None
    if price_text:
        try:
            price = float(price_text)
        except ValueError as exc:
            raise SpecError(f"{source}:{line}", "typical_cloud_usd_per_hour", "a number or empty",
                            price_text) from exc
    nvlink = (row.get("nvlink") or "").strip().lower()
    if nvlink not in ("yes", "no"):
        raise SpecError(f"{source}:{line}", "nvlink", "'yes' or 'no'", row.get("nvlink"))
    return GpuType(
        name=row["name"].strip(),
        memory_bytes=num("memory_gb") * GB,
        mem_bandwidth=num("mem_bandwidth_gb_per_s") * GB,
        fp16_flops=num("fp16_tensor_tflops") * 1e12,
        nvlink=nvlink == "yes",
        usd_per_hour=price,
    )


def load_gpu_table(path: str | Path) -> dict[str, GpuType]:
    """Read a GPU table in the ``gpus.csv`` layout into ``{name: GpuType}``."""
    path = Path(path)
    with path.open(newline="") as fh:
        return {g.name: g for g in (_parse_row(r, str(path), i + 2)
                                    for i, r in enumerate(csv.DictReader(fh)))}


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuType]:
    """The bundled GPU catalog."""
    with resources.as_file(resources.files("hetserve") / "data" / "gpus.csv") as p:
        return load_gpu_table(p)


def gpu(name: str, source: str = "gpu catalog", field: str = "gpu") -> GpuType:
    """Look a GPU type up by name, with a helpful error listing the known names."""
    catalog = gpu_catalog()
    if name not in catalog:
        raise SpecError(source, field, "one of " + ", ".join(sorted(catalog)), name)
    return catalog[name]
