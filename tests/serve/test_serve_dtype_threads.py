"""``hetserve serve --dtype``, ``--threads-per-worker`` and the step limits: what reaches the engine,
the default thread split, the dtype check before any worker starts, and the environment workers
start with."""

from __future__ import annotations

import json
import os

import pytest

from hetserve.cli.main import main as cli
from hetserve.errors import RuntimeFailure
from hetserve.policies.batching import DEFAULT_BATCHING
from hetserve.runtime.engine import OMP_SPIN_ENV, OMP_WAIT_ENV, bounded_omp_spin
from hetserve.runtime.engine_config import EngineConfig, check_dtype, worker_threads

PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}
TWO_REPLICAS = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0", "m0:1"], "layers": [0, 2]}]},
    {"id": "c1", "role": "colocated", "stages": [{"devices": ["m1:0"], "layers": [0, 2]}]}]}


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
               "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
               "vocab_size": 320, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "eos_token_id": 257,
               "bos_token_id": 256, "pad_token_id": 258, "dtype": "float32"}


def _layout(plan_dict: dict, tmp_path):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.deployment import build_layout
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.specs.cluster import load_cluster

    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))  # the shapes are all the layout reads
    arch = ArchConfig.from_dir(tmp_path)
    plan, cluster = Plan.from_dict(plan_dict), load_cluster("demo-cpu")
    return build_layout(plan, cluster, arch, {d: "cpu" for d in plan.devices}, source="test"), cluster


def test_default_threads_divide_each_hosts_cores_among_its_workers(tmp_path):
    layout, cluster = _layout(TWO_REPLICAS, tmp_path)
    # local backend: every worker on this host, 3 workers share 8 cores
    assert worker_threads(layout, EngineConfig(), lambda d: "here", cores=8) == {"m0:0": 2, "m0:1": 2, "m1:0": 2}
    # placed on the cluster's machines (Ray): m0 holds two workers, m1 one
    by_machine = worker_threads(layout, EngineConfig(), lambda d: cluster.device(d).machine, cores=8)
    assert by_machine == {"m0:0": 4, "m0:1": 4, "m1:0": 8}
    # never below one thread, however many workers share the host
    assert set(worker_threads(layout, EngineConfig(), lambda d: "here", cores=2).values()) == {1}
    # an explicit count wins everywhere
    assert set(worker_threads(layout, EngineConfig(threads_per_worker=3), lambda d: "here", cores=8).values()) == {3}
    with pytest.raises(ValueError, match="threads_per_worker"):
        EngineConfig(threads_per_worker=0)


def test_dtype_check_names_a_gpu_without_bfloat16(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "Tesla T4")
    with pytest.raises(RuntimeFailure, match=r"cuda:0 \(Tesla T4\) cannot run bfloat16"):
        check_dtype("bfloat16", {"cpu", "cuda:0"})
    check_dtype("float16", {"cuda:0"})  # every CUDA GPU computes in float16
    for dtype in ("float32", "bfloat16", "float16"):
        check_dtype(dtype, {"cpu"})  # this build of torch runs the layer's ops in each


def test_dtype_check_reports_a_cpu_kernel_that_is_missing(monkeypatch):
    import torch

    real = torch.nn.functional.linear

    def no_half(x, w, *a, **k):
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real(x, w, *a, **k)

    monkeypatch.setattr(torch.nn.functional, "linear", no_half)
    with pytest.raises(RuntimeFailure, match="cannot compute in float16.*serve it in float32"):
        check_dtype("float16", {"cpu"})


def test_workers_start_with_bounded_openmp_spins_only_when_multithreaded(monkeypatch):
    monkeypatch.delenv(OMP_WAIT_ENV, raising=False)
    monkeypatch.delenv(OMP_SPIN_ENV, raising=False)
    with bounded_omp_spin(True):
        assert os.environ[OMP_SPIN_ENV] == "10000"
    assert OMP_SPIN_ENV not in os.environ  # the engine's own environment is left as it was
    with bounded_omp_spin(False):
        assert OMP_SPIN_ENV not in os.environ
    for env, value in ((OMP_WAIT_ENV, "PASSIVE"), (OMP_SPIN_ENV, "300000")):  # the user's choice stands
        monkeypatch.setenv(env, value)
        with bounded_omp_spin(True):
            assert os.environ[env] == value and os.environ.get(OMP_SPIN_ENV) in (None, value)
        monkeypatch.delenv(env)


def test_serve_passes_dtype_and_threads_to_the_engine(tmp_path, monkeypatch):
    from hetserve.planner.plan import Plan
    from hetserve.serve import launch

    seen = {}

    class Stop(Exception):
        pass

    def fake_build(opts):
        seen.update(opts.engine_options, budget=opts.max_batched_tokens, seqs=opts.max_num_seqs)
        raise Stop

    monkeypatch.setattr(launch, "build", fake_build)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))  # what serve checks before building
    plan = tmp_path / "plan.json"
    Plan.from_dict(PLAN).save(plan)
    base = ["serve", "--plan", str(plan), "--cluster", "demo-cpu", "--model", str(model), "--port", "0"]
    with pytest.raises(Stop):
        cli(base + ["--dtype", "bfloat16", "--threads-per-worker", "3", "--max-batched-tokens", "512",
                    "--max-num-seqs", "16"])
    assert seen["dtype"] == "bfloat16" and seen["threads_per_worker"] == 3
    assert seen["budget"] == 512 and seen["seqs"] == 16
    with pytest.raises(Stop):
        cli(base)
    assert seen["dtype"] is None and seen["threads_per_worker"] is None  # the engine's defaults
    assert (seen["budget"], seen["seqs"]) == (DEFAULT_BATCHING.token_budget, DEFAULT_BATCHING.max_batch)


@pytest.mark.parametrize("option,value", [("--dtype", "int8"), ("--threads-per-worker", "0")])
def test_serve_refuses_a_bad_dtype_or_thread_count_in_one_line(tmp_path, capsys, option, value):
    assert cli(["serve", "--plan", str(tmp_path / "p.json"), "--model", str(tmp_path), option, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and option in err[0] and value in err[0], err


def test_the_engine_checks_the_dtype_and_gives_each_worker_its_threads(tmp_path, monkeypatch):
    """What ``Engine.from_plan`` hands each worker it starts: the dtype asked for and the threads
    ``worker_threads`` gives it, with OpenMP's spin bounded; a dtype the device cannot run
    stops it before any worker starts."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime import engine as engine_module
    from hetserve.runtime.workers.worker_group import WorkerGroup

    monkeypatch.delenv(OMP_WAIT_ENV, raising=False)
    monkeypatch.delenv(OMP_SPIN_ENV, raising=False)
    monkeypatch.setattr(engine_module, "check_weights", lambda d: None)
    monkeypatch.setattr("hetserve.runtime.engine_config.host_cores", lambda: 4)
    seen = []

    class Started(Exception):
        pass

    def start(self, make_config, start_method):
        seen.extend(make_config(w, None, "gloo") for r in self.layout for w in r.workers)
        seen.append(os.environ.get(OMP_SPIN_ENV))
        raise Started

    monkeypatch.setattr(WorkerGroup, "start", start)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    plan = Plan.from_dict(TWO_REPLICAS)
    with pytest.raises(Started):
        engine_module.Engine.from_plan(plan, "demo-cpu", tmp_path, EngineConfig(dtype="bfloat16", device="cpu"))
    *configs, omp = seen
    assert [(c.spec.name, c.threads, c.dtype) for c in configs] == [
        ("m0:0", 1, "bfloat16"), ("m0:1", 1, "bfloat16"), ("m1:0", 1, "bfloat16")]  # 4 cores, 3 workers
    assert omp is None  # one thread each: nothing waits on a partner thread
    seen.clear()
    with pytest.raises(Started):
        engine_module.Engine.from_plan(Plan.from_dict(PLAN), "demo-cpu", tmp_path, EngineConfig(device="cpu"))
    assert [(c.threads, c.dtype) for c in seen[:-1]] == [(4, "float32")] and seen[-1] == "10000"

    def cannot(dtype, devices):
        raise RuntimeFailure(f"no {dtype} here")

    monkeypatch.setattr(engine_module, "check_dtype", cannot)
    seen.clear()
    with pytest.raises(RuntimeFailure, match="no float16 here"):
        engine_module.Engine.from_plan(plan, "demo-cpu", tmp_path, EngineConfig(dtype="float16", device="cpu"))
    assert seen == []


def test_a_token_budget_below_the_sequence_cap_is_refused():
    """A step decodes up to max_num_seqs sequences, one token of the budget each, and never splits a
    prompt: a smaller budget could not be honoured, so it is refused, naming the chunked prefill that
    caps prompt tokens per step."""
    with pytest.raises(ValueError, match=r"max_batched_tokens must be at least max_num_seqs \(8\).*"
                                         r"prefill_mode='chunked' with chunk_tokens N\), got 1"):
        EngineConfig(max_batched_tokens=1, max_num_seqs=8)
    assert EngineConfig(max_batched_tokens=8, max_num_seqs=8).max_batched_tokens == 8


def test_serve_takes_a_token_budget_under_chunked_prefill_for_prefill_replicas(tmp_path, monkeypatch):
    """Under --prefill-mode chunked the budget still batches a prefill replica's prompts: accepted
    for a plan with one beside its colocated replicas (refused, as acting on nothing, for colocated
    replicas alone: the bad-input corpus)."""
    from hetserve.planner.plan import Plan
    from hetserve.serve import launch

    seen = {}

    class Stop(Exception):
        pass

    def fake_build(opts):
        seen.update(budget=opts.max_batched_tokens)
        raise Stop

    monkeypatch.setattr(launch, "build", fake_build)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
    Plan.from_dict({"model": "tiny", "cluster": "demo-cpu", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:1"], "layers": [0, 2]}]},
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}).save(tmp_path / "pd.json")
    with pytest.raises(Stop):
        cli(["serve", "--plan", str(tmp_path / "pd.json"), "--cluster", "demo-cpu", "--model", str(tmp_path / "tiny"),
             "--port", "0", "--prefill-mode", "chunked", "--max-batched-tokens", "512"])
    assert seen["budget"] == 512
