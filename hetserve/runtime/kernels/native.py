"""The C++ CPU kernels (``csrc/``), built for this machine at first use.

``paged_decode_attention`` reads the KV pool in place, one task per sequence, where the
plain-torch path gathers every context into a padded grid first. ``store_kv``, ``rms_norm`` and
``rotary`` each do in one pass what takes a layer 5-12 torch operators. The sources are compiled
once per machine and source version by ``torch.utils.cpp_extension`` (g++ and ninja; one
translation unit, about 20 s of one core, kept under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``, a folder per checkout, source version and CPU; concurrent builders
wait for one another, a killed build's lock does not stop the next, and a build removes the folders
of this checkout's earlier versions and of checkouts that are gone) and loaded as
``torch.ops.hetserve_cpu``. Where it cannot be built (no compiler, or ``HETSERVE_NATIVE_KERNELS=0``)
``available()`` is False, says why once in the log, and the kernels stay the plain-torch ones.

Compiled with ``-O3 -march=native -ffast-math`` and 512-bit vectors where the CPU has them (the
loops over the head dimension vectorise, ``exp`` included); ``-ffast-math`` is a compile flag
only, so the library does not switch the process's floating point to flush denormals.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
UNIT = CSRC / "cpu_kernels.cpp"  # includes the others: torch's headers parsed once
SOURCES = [CSRC / name for name in ("paged_decode_cpu.cpp", "layer_ops_cpu.cpp")]
ENV = "HETSERVE_NATIVE_KERNELS"
NAME = "hetserve_cpu_kernels"
OWNER = "hetserve-checkout"  # a build folder's file naming the source it was built from
BUILD_LOCK = "hetserve-build.lock"  # the OS lock builders and removers take on a build folder
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


@functools.cache
def available() -> bool:
    """Whether the C++ kernels are loaded (building them on the first call)."""
    if os.environ.get(ENV, "1") == "0":
        log.info("C++ CPU kernels off (%s=0): plain-torch kernels", ENV)
        return False
    try:
        _build()
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: the torch kernels
        log.warning("C++ CPU kernels unavailable (%s: %s); plain-torch kernels instead",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False
    return True


def build_name() -> str:
    """The build's name, and so its folder under torch's extensions root: one per checkout, source
    version, flags and CPU. Two checkouts on one machine (or one home folder shared by machines of
    different CPUs, the build being -march=native) each keep their own build rather than rebuilding
    over the other's: torch's build file names the sources by path, so even two checkouts of one
    version would take turns rebuilding a shared folder."""
    h = hashlib.sha256(str(UNIT.resolve()).encode())
    for p in (UNIT, *SOURCES):
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(_cpu_model().encode())
    return f"{NAME}_{h.hexdigest()[:12]}"


def _cpu_tag() -> str:
    """A short name of the CPU a build is for (its owner file keeps it)."""
    return hashlib.sha256(_cpu_model().encode()).hexdigest()[:12]


def _cpu_model() -> str:
    """The CPU's name and instruction-set flags (its first core's), which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))


def _build() -> None:
    """Build (or load the cached build of) the kernels, one process at a time.

    torch's own build lock is a file that a killed build leaves behind, and every later build waits
    on it forever. Builders here first take an OS lock on a file beside it, which the kernel
    releases when its holder dies: whoever holds it knows that a torch lock left there is stale
    (only builders of this very version use this folder: ``build_name``)."""
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = Path(cpp_extension._get_build_directory(name, False))
    with builders_lock(build_dir):
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, the build lock of a build that was killed", stale)
            stale.unlink()
        cpp_extension.load(name=name, sources=[str(UNIT)], is_python_module=False, build_directory=str(build_dir),
                           extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        (build_dir / OWNER).write_text(f"{UNIT.resolve()}\n{_cpu_tag()}")
    remove_stale_builds(build_dir)


@contextlib.contextmanager
def builders_lock(build_dir: Path):
    """The OS lock every builder of ``build_dir`` holds while it touches torch's lock there."""
    with open(build_dir / BUILD_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def remove_stale_builds(build_dir: Path) -> list[Path]:
    """Remove the build folders beside ``build_dir`` that no checkout will load again: those built
    from this checkout's source path (an earlier version: every version has a folder of its own,
    ``build_name``; but not one built for another CPU, on a machine sharing this home folder) and
    those whose source is gone (a deleted checkout). Folders without an owner
    file are not hetserve's to judge; a folder whose builder holds its lock is left for later.
    A process that loaded a removed build keeps running: the library stays mapped."""
    here, cpu = str(UNIT.resolve()), _cpu_tag()
    removed = []
    for other in build_dir.parent.glob(f"{NAME}_*"):
        owner = other / OWNER
        if other == build_dir or not owner.is_file():
            continue
        try:
            source, _, built_for = owner.read_text().strip().partition("\n")
        except OSError:
            continue
        if source != here and os.path.exists(source):
            continue
        if source == here and built_for and built_for != cpu:
            continue  # this checkout's build for another machine's CPU (a home folder they share)
        try:
            with open(other / BUILD_LOCK, "a") as held:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(other)
        except OSError:  # being built right now, or not ours to remove
            continue
        log.info("removed %s, a build no checkout loads any more (%s)", other, source)
        removed.append(other)
    return removed


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``kernels.paged_decode_attention`` on CPU tensors, by the C++ kernel (``available()`` first)."""
    return torch.ops.hetserve_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``kernels.store_kv`` for k, v of the caches' dtype."""
    torch.ops.hetserve_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kernels.rms_norm`` for x and weight of one dtype."""
    return torch.ops.hetserve_cpu.rms_norm(x, weight, float(eps))


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.rotary`` for q, k, cos and sin of one dtype."""
    return torch.ops.hetserve_cpu.rotary(q, k, cos, sin)
