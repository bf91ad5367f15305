"""Loading a stage: built on the meta device, each TP rank reads only its slices, in the dtype asked.

Reads are watched at the safetensors boundary (``loader.safe_open`` wrapped), so a loader that
read a whole tensor and sliced it afterwards would show a read larger than the shard it fills.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from hetserve.runtime.model import cpu_weights, loader
from hetserve.runtime.model.config import LLAMA2_7B, ArchConfig, llama_arch
from hetserve.runtime.model.cpu_weights import linear_weight
from hetserve.runtime.model.loader import STAGE_CLASSES, load_stage, meta_stage
from hetserve.runtime.model.make import random_stage

ROW_BIASES = ("o_proj.bias", "down_proj.bias", "out_proj.bias", "fc2.bias")


class _SliceSpy:
    def __init__(self, part, name, reads):
        self.part, self.name, self.reads = part, name, reads

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, key):
        tensor = self.part[key]
        self.reads.append((self.name, tuple(tensor.shape), tensor.numel() * tensor.element_size()))
        return tensor


class _FileSpy:
    """A safe_open handle that records the shape and bytes of every slice read through it."""

    def __init__(self, real, reads):
        self.real, self.reads = real, reads

    def __enter__(self):
        self.real.__enter__()
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def keys(self):
        return self.real.keys()

    def get_slice(self, name):
        return _SliceSpy(self.real.get_slice(name), name, self.reads)


@pytest.fixture
def reads(monkeypatch):
    log: list[tuple[str, tuple[int, ...], int]] = []
    real = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", lambda *a, **k: _FileSpy(real(*a, **k), log))
    return log


def _full_then_sliced(cfg: ArchConfig, full: dict[str, torch.Tensor], name: str, rank: int, world: int):
    """The old way: the whole checkpoint tensor, then this rank's part of it."""
    cls = STAGE_CLASSES[cfg.arch]
    key = next(k for k in cls.checkpoint_keys(name, 0, cfg) if k in full)
    tensor = full[key]
    module, pname = name.rsplit(".", 1)
    kind = cls.TP_PLAN.get(module.rsplit(".", 1)[-1])
    if kind == "column":
        return tensor.chunk(world, 0)[rank]
    if kind == "row" and pname == "weight":
        return tensor.chunk(world, 1)[rank]
    if kind == "row":  # bias: added once, by rank 0
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return tensor


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_tp_rank_reads_only_its_shard(arch, model_dirs, reads):
    d = model_dirs[arch]
    cfg = ArchConfig.from_dir(d)
    stage, report = load_stage(cfg, d, (0, cfg.num_layers), has_embed=False, has_head=False, tp_rank=1, tp_world=2)
    full = load_file(str(d / "model.safetensors"))

    q = "model.layers.0.self_attn.q_proj.weight" if arch == "llama" else "model.decoder.layers.0.self_attn.q_proj.weight"
    rows = full[q].shape[0]
    assert torch.equal(stage.layers[0].self_attn.q_proj.weight, full[q][rows // 2:])
    assert [shape for name, shape, _ in reads if name == q] == [(rows // 2, full[q].shape[1])]
    for name, param in stage.named_parameters():
        assert torch.equal(param, _full_then_sliced(cfg, full, name, 1, 2)), name
    # every byte read fills this rank's parameters: no whole tensor read and sliced afterwards,
    # and no row-parallel bias read by a rank that holds zeros
    held = sum(p.numel() * p.element_size() for n, p in stage.named_parameters() if not n.endswith(ROW_BIASES))
    assert report.bytes_read == sum(nbytes for _, _, nbytes in reads) == held
    assert report.tensors == len(list(stage.parameters())) and report.source == str(d)


def test_a_whole_stage_reads_the_whole_checkpoint_once(model_dirs, reads):
    d = model_dirs["llama"]
    cfg = ArchConfig.from_dir(d)
    _, report = load_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True)
    full = load_file(str(d / "model.safetensors"))
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in full.values())
    assert sorted(name for name, _, _ in reads) == sorted(full)
    assert report.as_dict()["bytes_read"] == report.bytes_read


def test_the_meta_build_holds_no_weights():
    cfg = llama_arch(**LLAMA2_7B)
    whole = meta_stage(cfg, cfg.num_layers, has_embed=True, has_head=True)
    assert all(p.is_meta for p in whole.parameters())
    assert sum(p.numel() for p in whole.parameters()) == 6_738_415_616  # Llama-2-7B's parameter count
    shard = meta_stage(cfg, 1, has_embed=False, has_head=False, tp_rank=1, tp_world=4)
    assert all(p.is_meta for p in shard.parameters())
    assert shard.layers[0].self_attn.q_proj.weight.shape == (1024, 4096)
    assert shard.layers[0].mlp.down_proj.weight.shape == (4096, 2752)


class _Float32Made(TorchDispatchMode):
    """Records the size of every float32 tensor an op makes off the meta device."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and not t.is_meta:
                self.sizes.append(t.numel())
        return out


def test_a_bf16_load_makes_no_float32_weights(model_dirs, tmp_path):
    src = model_dirs["llama"]
    full = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in full.items()}, str(tmp_path / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    shutil.copy(src / "generation_config.json", tmp_path)
    cfg = ArchConfig.from_dir(tmp_path)
    with _Float32Made() as made:
        stage, _ = load_stage(cfg, tmp_path, (0, cfg.num_layers), has_embed=True, has_head=True,
                              dtype=torch.bfloat16)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in stage.parameters()} == {"cpu"}
    # only RoPE's frequencies (head_dim / 2 values) are float32; the smallest weight is a norm of hidden
    assert max(made.sizes, default=0) < cfg.hidden_size


def test_random_stage_is_made_on_its_device_in_its_dtype():
    cfg = llama_arch(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=300)
    with _Float32Made() as made:
        a = random_stage(cfg, 2, "cpu", torch.bfloat16, seed=3, has_embed=True, has_head=True)
    assert max(made.sizes, default=0) < cfg.hidden_size
    b = random_stage(cfg, (0, 2), "cpu", torch.bfloat16, seed=3, has_embed=True, has_head=True)
    c = random_stage(cfg, 2, "cpu", torch.bfloat16, seed=4, has_embed=True, has_head=True)
    pairs = list(zip(_weights(a).values(), _weights(b).values(), _weights(c).values()))
    assert len(pairs) == len(_weights(a)) > 2 * 7
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, q) for p, q, _ in pairs)
    assert not torch.equal(_weights(a)["layers.0.self_attn.q_proj.weight"],
                           _weights(c)["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert a.inv_freq is not None and not a.training


def _weights(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``stage`` by name, linear weights as plain (out, in) tensors whatever their layout."""
    out = {name: p for name, p in stage.named_parameters()}
    for name, mod in stage.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out[f"{name}.weight"] = linear_weight(mod)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_linear_weights_take_their_dtypes_layout(model_dirs, dtype):
    """A CPU stage's float32 linear weights are (in, out)-contiguous transposes holding the
    checkpoint's values; bfloat16 ones are packed for oneDNN (no plain copy kept), holding the same
    values (where oneDNN has a bfloat16 GEMM; else row-major); float16 stays row-major; other
    parameters stay as they are."""
    d = model_dirs["llama"]
    cfg = ArchConfig.from_dir(d)
    stage, _ = load_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True, dtype=dtype)
    full = load_file(str(d / "model.safetensors"))
    linears = {name for name, mod in stage.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert "lm_head" in linears and len(linears) == 7 * cfg.num_layers + 1
    packed = {name for name, mod in stage.named_modules() if getattr(mod, "packed_weight", None) is not None}
    assert packed == (linears if dtype == torch.bfloat16 and cpu_weights.bfloat16_packing_works() else set())
    for name in packed:
        assert stage.get_submodule(name).weight is None and stage.get_submodule(name).packed_weight.is_mkldnn
    for name, param in _weights(stage).items():
        module = name.rsplit(".", 1)[0]
        column_major = dtype == torch.float32 and module in linears and name.endswith("weight")
        assert param.is_contiguous() != column_major, name
        assert not column_major or param.t().is_contiguous(), name
        key = next(k for k in STAGE_CLASSES["llama"].checkpoint_keys(name, 0, cfg) if k in full)
        assert torch.equal(param, full[key].to(dtype)), name


def test_a_layer_of_random_weights_is_the_same_in_every_stage_that_holds_it():
    cfg = llama_arch(hidden=64, heads=4, kv_heads=2, ffn=128, layers=3, vocab=300)
    whole = _weights(random_stage(cfg, (0, 3), "cpu", torch.float32, seed=5, has_embed=True))
    tail = _weights(random_stage(cfg, (1, 3), "cpu", torch.float32, seed=5, has_head=True))
    for name, w in tail.items():
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            assert torch.equal(w, whole[name.replace(f"layers.{i}.", f"layers.{i + 1}.", 1)]), name
    assert not torch.equal(whole["layers.0.self_attn.q_proj.weight"], whole["layers.1.self_attn.q_proj.weight"])


@pytest.mark.timeout(180)
def test_a_random_weights_folder_serves_the_same_tokens_through_one_stage_or_a_pipeline(tmp_path, cluster_file):
    """``make-model --random-weights``: no weights file; each worker draws its layers on its device,
    so one stage and a two-stage pipeline of the same folder give the same greedy tokens."""
    from hetserve.cli.main import main
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine import Engine
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.params import SamplingParams

    folder = tmp_path / "recipe"
    assert main(["make-model", "--layers", "3", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--random-weights", "--seed", "7", "-o", str(folder)]) == 0
    assert not list(folder.glob("*.safetensors")) and (folder / "random_weights.json").is_file()
    plan = Plan.from_dict({"model": "tiny", "cluster": "runtime-test", "replicas": [
        {"id": "one", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 3]}]},
        {"id": "two", "role": "colocated", "stages": [{"devices": ["m0:1"], "layers": [0, 1]},
                                                      {"devices": ["m0:2"], "layers": [1, 3]}]}]})
    eng = Engine.from_plan(plan, cluster_file, folder, EngineConfig(kv_capacity_tokens=1024))
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        prompts = [[5, 6, 7, 8], [40, 41]]
        one = [eng.submit(p, params, replica="one").result(timeout=60) for p in prompts]
        two = [eng.submit(p, params, replica="two").result(timeout=60) for p in prompts]
        assert one == two and len(set(map(tuple, one))) == 2
        loads = eng.worker_loads()
        assert loads and all(v["source"].startswith("random weights (seed 7)") and v["bytes_read"] == 0
                             for v in loads.values())
    finally:
        eng.shutdown()
