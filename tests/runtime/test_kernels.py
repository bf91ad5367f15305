"""The paged-attention kernels (Triton under its interpreter, the C++ CPU kernel, and the torch
path) against the per-sequence loops of ``hetserve.runtime.kernels.reference``, on hypothesis-drawn shapes.

Every case's pool holds NaN in each slot no sequence owns and its block tables hold -1 past each
sequence's blocks (``kernels.cases``), so a kernel reading outside a context fails here.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: see triton_kernels

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hetserve.runtime import kernels
from hetserve.runtime.kernels import (  # triton: the dev extra
    cases,
    native,
    reference,
    triton_kernels,
)

# examples per test in `make test`: the interpreter runs a Triton program in milliseconds, so the
# Triton draws stay few here; the `long` copies draw more, bench/check_kernels.py hundreds
FEW = {"triton": settings(max_examples=4, deadline=None), "torch": settings(max_examples=12, deadline=None)}
MANY = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one torch thread is many times faster than two on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@st.composite
def shapes(draw, prefill: bool = False, dtype: str | None = None) -> cases.Shape:
    """GQA ratios 1/4/8, block sizes 16/32, contexts ending anywhere in a block (0 included),
    batches of 1-64 (a large batch gets short contexts: the interpreter runs programs one by one)."""
    batch = draw(st.one_of(st.integers(1, 4), st.integers(5, 64)))
    longest = 90 if batch <= 4 else 16
    context_lens = tuple(draw(st.lists(st.integers(0, longest), min_size=batch, max_size=batch)))
    q_lens = None
    if prefill:
        q_lens = tuple(draw(st.integers(min(1, n), min(n, 24))) for n in context_lens)
    return cases.Shape(context_lens=context_lens, num_kv_heads=draw(st.sampled_from([1, 2])),
                       group=draw(st.sampled_from([1, 4, 8])), head_dim=draw(st.sampled_from([16, 24, 64])),
                       block_size=draw(st.sampled_from([16, 32])),
                       dtype=dtype or draw(st.sampled_from(["fp32", "bf16"])), q_lens=q_lens)


def assert_close(out: torch.Tensor, ref: torch.Tensor, shape: cases.Shape) -> None:
    assert out.dtype == cases.DTYPES[shape.dtype]
    assert torch.isfinite(out).all(), shape.describe()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= cases.TOLERANCE[shape.dtype], f"{shape.describe()} {shape.dtype}: max abs error {err:.2e}"


def decode(case: cases.Case, impl: str, num_splits: int | None = None) -> torch.Tensor:
    args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, case.scale)
    if impl == "triton":
        return triton_kernels.paged_decode_attention(*args, num_splits=num_splits)
    return kernels.paged_decode_attention(*args, impl=impl)


def prefill(case: cases.Case, impl: str) -> torch.Tensor:
    return kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                           case.query_start_loc, case.context_lens, case.scale, impl=impl)


def decode_reference(case: cases.Case) -> torch.Tensor:
    return reference.paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.context_lens, case.scale)


def prefill_reference(case: cases.Case) -> torch.Tensor:
    return reference.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                             case.query_start_loc, case.context_lens, case.scale)


def check_decode(impl: str, shape: cases.Shape, num_splits: int | None, seed: int) -> None:
    """Split-KV decode (1-3 splits, some past a row's context) equals softmax over the whole context."""
    case = cases.make_case(shape, seed)
    assert_close(decode(case, impl, num_splits), decode_reference(case), shape)


def check_prefill(impl: str, shape: cases.Shape, seed: int) -> None:
    """Chunked prefill: query i of a sequence sees positions up to context - q_len + i, no further."""
    case = cases.make_case(shape, seed)
    assert_close(prefill(case, impl), prefill_reference(case), shape)


def check_store(impl: str, shape: cases.Shape, seed: int) -> None:
    """Each row lands in its slot, bit for bit; rows with slot -1 write nothing."""
    k, v, k_cache, v_cache, slots = cases.store_inputs(shape, seed)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kernels.store_kv(k, v, k_cache, v_cache, slots, impl=impl)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert (slots == -1).any()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


SPLITS = st.sampled_from([None, 1, 2, 3])
SEEDS = st.integers(0, 2**16)
# drawn or not, every run checks two KV heads of four query heads each, contexts spanning three
# splits beside an empty one, a non-power-of-two head size, a chunk after earlier context, float16
GQA = {"num_kv_heads": 2, "group": 4, "head_dim": 24, "block_size": 16}
DECODE_CASE = cases.Shape(context_lens=(37, 70, 0, 5), dtype="bf16", **GQA)
PREFILL_CASE = cases.Shape(context_lens=(40, 70, 0, 3), q_lens=(40, 9, 0, 1), dtype="fp32", **GQA)
FP16_DECODE = cases.Shape(context_lens=(33, 2), dtype="fp16", **GQA)
FP16_PREFILL = cases.Shape(context_lens=(20, 5), q_lens=(4, 5), dtype="fp16", **GQA)
# the head sizes the C++ decode kernel compiles with their size (64, 128), beside runtime ones above
SIZED = [cases.Shape(context_lens=(37, 70, 0, 5), num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype="bf16"),
         cases.Shape(context_lens=(33, 130), num_kv_heads=2, group=2, head_dim=128, block_size=16, dtype="fp32"),
         cases.Shape(context_lens=(1, 90), num_kv_heads=1, group=8, head_dim=128, block_size=32, dtype="bf16")]


@FEW["triton"]
@given(shape=shapes(), num_splits=SPLITS, seed=SEEDS)
@example(shape=DECODE_CASE, num_splits=3, seed=0)
@example(shape=FP16_DECODE, num_splits=2, seed=0)
def test_triton_decode_matches_reference(shape, num_splits, seed):
    check_decode("triton", shape, num_splits, seed)


@pytest.mark.parametrize("impl", ["torch", "native"])
@FEW["torch"]
@given(shape=shapes(), seed=SEEDS)
@example(shape=DECODE_CASE, seed=0)
@example(shape=FP16_DECODE, seed=0)
@example(shape=SIZED[0], seed=0)
@example(shape=SIZED[1], seed=1)
@example(shape=SIZED[2], seed=2)
def test_cpu_decode_matches_reference(impl, shape, seed):
    check_decode(impl, shape, None, seed)


@FEW["triton"]
@given(shape=shapes(prefill=True), seed=SEEDS)
@example(shape=PREFILL_CASE, seed=0)
@example(shape=FP16_PREFILL, seed=0)
def test_triton_prefill_matches_reference(shape, seed):
    check_prefill("triton", shape, seed)


@FEW["torch"]
@given(shape=shapes(prefill=True), seed=SEEDS)
@example(shape=PREFILL_CASE, seed=0)
@example(shape=FP16_PREFILL, seed=0)
def test_torch_prefill_matches_reference(shape, seed):
    check_prefill("torch", shape, seed)


@pytest.mark.parametrize("impl", ["triton", "native", "torch"])
@FEW["triton"]
@given(shape=shapes(), seed=SEEDS)
def test_store_kv_writes_slots_and_skips_minus_one(impl, shape, seed):
    check_store(impl, shape, seed)


@pytest.mark.long
@pytest.mark.parametrize("impl", ["triton", "torch"])
@MANY
@given(decode_shape=shapes(), prefill_shape=shapes(prefill=True), num_splits=SPLITS, seed=SEEDS)
def test_many_shapes(impl, decode_shape, prefill_shape, num_splits, seed):
    check_decode(impl, decode_shape, num_splits if impl == "triton" else None, seed)
    check_prefill(impl, prefill_shape, seed)
    check_store(impl, decode_shape, seed)


@pytest.mark.long
@MANY
@given(shape=shapes(), seed=SEEDS)
def test_native_many_shapes(shape, seed):
    check_decode("native", shape, None, seed)


@pytest.mark.parametrize("impl", ["triton", "native", "torch"])
def test_rows_of_context_zero_give_zeros(impl):
    """Padding rows of a graph bucket: context 0, a table of -1, a pool of NaN -> zeros, nothing read."""
    shape = cases.Shape(context_lens=(0, 37, 0), num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype="fp32")
    case = cases.make_case(shape, seed=1)
    out = decode(case, impl)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close(out, decode_reference(case), shape)


def test_public_triton_path_on_a_long_context():
    """Through the public API with impl='triton': a context long enough for the default to split it,
    and a block table whose rows are not contiguous."""
    shape = cases.Shape(context_lens=(600, 5), num_kv_heads=1, group=4, head_dim=16, block_size=32, dtype="bf16")
    assert triton_kernels.decode_splits(600, 32)[0] > 1
    case = cases.make_case(shape, seed=2)
    assert_close(decode(case, "torch"), decode_reference(case), shape)
    column_major = case.block_tables.t().contiguous().t()  # same entries, rows no longer contiguous
    out = kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, column_major,
                                         case.context_lens, case.scale, impl="triton")
    assert_close(out, decode_reference(case), shape)


def test_the_cpu_kernels_build_here_and_are_the_default():
    """The C++ kernels build wherever g++ and ninja are, as on every machine the tests run on: a
    build that breaks fails here (and every "native" case), not silently back to the torch kernels."""
    assert native.available(), "the C++ CPU kernels did not build: the log says why"
    assert kernels.resolve_impl(None, torch.device("cpu")) == "native"


def test_a_killed_builds_lock_does_not_stop_the_next_build():
    """torch's build lock outlives a build that was killed; the next build must not wait on it forever."""
    from torch.utils import cpp_extension

    build_dir = cpp_extension._get_build_directory(native.build_name(), False)
    stale = os.path.join(build_dir, "lock")
    # Other test workers load the kernels too, and torch's lock exists while any of them loads:
    # the stale lock is left, and looked for, only while no builder holds the builders' OS lock.
    with native.builders_lock(Path(build_dir)):
        open(stale, "w").close()
    code = "from hetserve.runtime.kernels import native; native._build(); print('built')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-2000:]
    with native.builders_lock(Path(build_dir)):
        assert not os.path.exists(stale)


def test_each_checkout_and_source_version_builds_in_its_own_folder(tmp_path, monkeypatch):
    """Two checkouts of one version must not share a build folder (torch's build file names the
    sources by path: they would take turns rebuilding), nor two versions at one path."""
    here = native.build_name()
    copies = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for src in (native.UNIT, *native.SOURCES):
            (tmp_path / name / src.name).write_bytes(src.read_bytes())
        copies.append(tmp_path / name)
    names = []
    for folder in copies:
        monkeypatch.setattr(native, "UNIT", folder / native.UNIT.name)
        monkeypatch.setattr(native, "SOURCES", [folder / s.name for s in native.SOURCES])
        names.append(native.build_name())
    assert len({here, *names}) == 3
    (copies[1] / native.UNIT.name).write_text((copies[1] / native.UNIT.name).read_text() + "\n// edited\n")
    assert native.build_name() != names[1]  # the same path, another version


def test_a_build_removes_this_checkouts_earlier_builds_and_those_of_deleted_checkouts(tmp_path):
    """Each checkout and version builds in a folder of its own; without clean-up they pile up. Kept:
    the current build, other live checkouts' builds, folders hetserve did not write, and a folder
    whose builder holds its lock."""
    import fcntl

    here = str(native.UNIT.resolve())
    live = tmp_path / "live-checkout.cpp"
    live.write_text("")
    owners = {"current": here, "earlier": here, "deleted": str(tmp_path / "gone" / "cpu_kernels.cpp"),
              "live": str(live), "foreign": None, "building": here}
    folders = {}
    for key, owner in owners.items():
        folders[key] = tmp_path / f"{native.NAME}_{key}"
        folders[key].mkdir()
        (folders[key] / "kernels.so").write_bytes(b"\0")
        if owner is not None:
            (folders[key] / native.OWNER).write_text(owner)
    with open(folders["building"] / "hetserve-build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = native.remove_stale_builds(folders["current"])
    assert sorted(removed) == sorted([folders["earlier"], folders["deleted"]])
    assert {k for k, f in folders.items() if f.exists()} == {"current", "live", "foreign", "building"}


def test_this_checkouts_build_for_another_cpu_is_kept(tmp_path):
    """A home folder shared by machines of different CPUs keeps one build per CPU (-march=native):
    each machine removes only its own earlier builds, not the other's."""
    here = str(native.UNIT.resolve())
    owners = {"current": f"{here}\n{native._cpu_tag()}", "earlier": f"{here}\n{native._cpu_tag()}",
              "other-cpu": f"{here}\n0123456789ab"}
    folders = {}
    for key, owner in owners.items():
        folders[key] = tmp_path / f"{native.NAME}_{key}"
        folders[key].mkdir()
        (folders[key] / native.OWNER).write_text(owner)
    assert native.remove_stale_builds(folders["current"]) == [folders["earlier"]]
    assert folders["other-cpu"].exists()


def test_impl_choice(monkeypatch):
    with pytest.raises(ValueError, match="'triton', 'native', 'torch'"):
        kernels.resolve_impl("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="impl='native' runs on CPU tensors"):
        kernels.resolve_impl("native", torch.device("cuda"))
    monkeypatch.setenv(native.ENV, "0")  # the way out: the plain-torch kernels
    native.available.cache_clear()
    try:
        assert kernels.resolve_impl(None, torch.device("cpu")) == "torch"
        with pytest.raises(ValueError, match="built: False"):
            kernels.resolve_impl("native", torch.device("cpu"))
    finally:
        native.available.cache_clear()


def test_native_kernel_refuses_a_block_outside_the_pool_and_keeps_denormals():
    """The C++ loops read unchecked, so the entry point checks every block a context reads; and
    building with -ffast-math must not make the process flush denormals."""
    shape = cases.Shape(context_lens=(37, 5), num_kv_heads=2, group=4, head_dim=32, block_size=16, dtype="fp32")
    case = cases.make_case(shape, seed=4)
    tables = case.block_tables.clone()
    tables[0, 2] = case.k_cache.shape[0]  # the third block of a 37-token context: one past the pool
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, tables, case.context_lens, case.scale,
                                       impl="native")
    with pytest.raises(RuntimeError, match="needs 3 blocks"):
        kernels.paged_decode_attention(case.q, case.k_cache, case.v_cache, tables[:, :2], case.context_lens,
                                       case.scale, impl="native")
    assert (torch.tensor([1e-40]) * 2).item() != 0.0


def test_triton_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    kernels.triton_available.cache_clear()
    try:
        with pytest.raises(ValueError, match="needs the triton package"):
            kernels.resolve_impl("triton", torch.device("cpu"))
        assert kernels.resolve_impl(None, torch.device("cuda")) == "torch"
    finally:
        kernels.triton_available.cache_clear()


def test_torch_path_builds_a_layout_once_per_metadata_and_never_reuses_a_stale_one(monkeypatch):
    """Every layer of a step passes the same metadata: the torch path builds its gather layout once.
    Metadata changed in place (the same tensor objects) gets a new layout and the right answer."""
    from hetserve.runtime.kernels import torch_impl

    built = []
    real = torch_impl.decode_layout
    monkeypatch.setattr(torch_impl, "decode_layout", lambda *a: built.append(1) or real(*a))
    shape = cases.Shape(context_lens=(37, 70, 5), **{**GQA, "num_kv_heads": 2}, dtype="fp32")
    case = cases.make_case(shape, seed=3)
    for _ in range(3):  # three layers
        assert_close(decode(case, "torch"), decode_reference(case), shape)
    assert len(built) == 1
    case.context_lens[1] = 40  # a shorter context, in place: what the pool holds past 40 is now out
    assert_close(decode(case, "torch"), decode_reference(case), cases.Shape(context_lens=(37, 40, 5), **GQA,
                                                                             dtype="fp32"))
    assert len(built) == 2


def test_every_triton_kernel_compiles_for_a_cuda_gpu():
    """The interpreter runs kernels the GPU compiler refuses; compile each launch the wrappers make
    for sm_90 (no GPU needed), in a process whose triton is not the interpreter's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "compile_for_cuda.py")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = done.stdout.count("compiled ")
    assert compiled >= 8, done.stdout


def test_triton_that_cannot_launch_on_a_gpu_falls_back_to_the_torch_kernels_once_and_says_so(monkeypatch, caplog):
    """Triton builds its launcher with the host's C compiler at the first launch: where that fails
    every Triton launch would, so the default kernels on that GPU are the torch ones, decided by one
    probe launch per GPU and logged (a worker reports ``describe``)."""
    tried = []

    def fails(device):
        tried.append(device)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.\nmore")

    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "_probe_launch", fails)
    kernels._triton_failure.cache_clear()
    try:
        with caplog.at_level("WARNING", "hetserve.runtime.kernels"):
            assert kernels.resolve_impl(None, torch.device("cuda", 0)) == "torch"
            assert kernels.resolve_impl(None, torch.device("cuda", 0)) == "torch"
        assert tried == [torch.device("cuda", 0)]
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(kernels.TRITON_FAILED)]
        assert kernels.describe(torch.device("cuda", 0)) == (
            f"torch ({kernels.TRITON_FAILED}: RuntimeError: Failed to find C compiler. Please specify via CC "
            "environment variable.)")
        assert kernels.resolve_impl("triton", torch.device("cuda", 0)) == "triton"  # asked for: no probe, no fallback
        monkeypatch.setattr(kernels, "_probe_launch", lambda device: None)
        gpu1 = torch.device("cuda", 1)
        assert kernels.resolve_impl(None, gpu1) == "triton" == kernels.describe(gpu1)
    finally:
        kernels._triton_failure.cache_clear()


def test_the_triton_probe_launch_itself_runs(monkeypatch):
    """The probe's kernel call is a real one (here under Triton's interpreter): a probe that raised
    for a mistake of its own would turn Triton off on every GPU."""
    kernels._probe_launch(torch.device("cpu"))
