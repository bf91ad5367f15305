"""The GPU checks' parts that run without a GPU (bench/gpu/): the wheels carried to the GPU machine."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _requirements(path: Path) -> dict[str, str]:
    """name (lower case, '_' as '-') -> pinned version, of a file of ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def test_gpu_wheels_are_pinned_to_the_tested_versions():
    """Every wheel carried to the GPU machine is the version the project is tested with, msgpack
    (the workers' wire format) among them."""
    wheels = _requirements(ROOT / "bench" / "gpu" / "wheels.txt")
    tested = _requirements(ROOT / "requirements" / "constraints.txt")
    assert "msgpack" in wheels
    off = {n: (v, tested.get(n)) for n, v in wheels.items() if tested.get(n) != v}
    assert not off, f"bench/gpu/wheels.txt (pinned, tested): {off}"


def test_make_gpu_wheels_reads_the_list():
    """The Makefile takes its list from bench/gpu/wheels.txt (one list for make and env.sh)."""
    make = (ROOT / "Makefile").read_text()
    assert "GPU_WHEELS := $(shell grep -v '^\\#' bench/gpu/wheels.txt)" in make
    assert "bench/gpu/wheels.txt" in (ROOT / "bench" / "gpu" / "env.sh").read_text()
