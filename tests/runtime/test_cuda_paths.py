"""What the CUDA-only paths decide, checked on a CPU with stand-ins where CUDA would run: graphs
captured at a worker's start-up, before it is ready (no receiving thread may use the device
during a capture); a TP group's host headers over gloo beside NCCL; CUDA IPC allocations released
when a transfer is refused; a stage's time on the GPU; which GPU a plan device gets, at the start
and after a re-plan. Each test names the rule it guards; the GPU run (bench/gpu) checks
the rest."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from hetserve.runtime.layout import ReplicaSpec, WorkerSpec
from hetserve.runtime.model.runner import CAPTURE_FAILED, StepRunner
from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.transport import InProcHub
from hetserve.runtime.workers.wire import ENGINE
from hetserve.runtime.workers.worker import Worker, WorkerConfig


def _stage(model_dirs):
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.loader import build_stage
    from hetserve.runtime.workers.kv_pool import KVPool

    cfg = ArchConfig.from_dir(model_dirs["llama"])
    stage = build_stage(cfg, model_dirs["llama"], (0, cfg.num_layers), has_embed=True, has_head=True)
    pool = KVPool(cfg.num_layers, 512, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    return cfg, stage, pool


def test_capture_all_captures_every_bucket_largest_first_on_padding_rows_and_steps_then_only_replay(model_dirs):
    cfg, stage, pool = _stage(model_dirs)
    runner = StepRunner(stage, pool.layers(), 16, cfg.hidden_size, torch.float32, torch.device("cpu"),
                        max_batch=32, max_blocks=8)
    runner.graphs = True  # as on a GPU with Triton; the capture itself is stood in for
    captured, replays = [], []

    def capture(bucket, meta):
        captured.append((bucket, meta.slot_mapping.tolist(), meta.parts[0].context_lens.tolist()))
        runner._graphs[bucket] = type("G", (), {"replay": lambda self: replays.append(bucket)})()
        runner._outputs[bucket] = torch.zeros(bucket, cfg.hidden_size)
        return True

    runner._capture = capture
    runner.slots[:4] = 5  # a step ran before: its slots must not be written by the captures' warm-ups
    assert runner.capture_all() == "on: 6 buckets captured"
    assert [b for b, _, _ in captured] == [32, 16, 8, 4, 2, 1]
    assert all(slots == [-1] * b and ctx == [0] * b for b, slots, ctx in captured)
    runner._capture = lambda *a: (_ for _ in ()).throw(AssertionError("captured after start-up"))
    with torch.inference_mode():
        step = runner.prepare([3, 9, 4], [1, 1, 1], [[0], [1], [2]])
        runner.run(step, torch.zeros(3, cfg.hidden_size))
    assert replays == [4]


def test_a_failed_capture_turns_graphs_off_says_so_and_the_steps_run_eagerly(model_dirs, caplog):
    cfg, stage, pool = _stage(model_dirs)
    runner = StepRunner(stage, pool.layers(), 16, cfg.hidden_size, torch.float32, torch.device("cpu"),
                        max_batch=8, max_blocks=8)
    runner.graphs = True  # the real capture, which fails on a CPU as a failing GPU capture would
    with caplog.at_level(logging.WARNING, "hetserve.runtime.model.runner"):
        note = runner.capture_all()
    assert note.startswith(f"off: {CAPTURE_FAILED} at bucket 8") and not runner.graphs and not runner._graphs
    assert any(r.getMessage().startswith(CAPTURE_FAILED) for r in caplog.records)
    with torch.inference_mode():
        step = runner.prepare([3], [1], [[0]])
        assert runner.run(step, torch.zeros(1, cfg.hidden_size)).shape == (1, cfg.hidden_size)


def test_a_worker_captures_its_graphs_before_it_says_ready_and_reports_how_it_went(model_dirs, monkeypatch):
    """Once ready, peers send KV pieces and activations whose receiving threads use the device; a
    graph captured then would fail (or, with a device-wide sync on those threads, break theirs)."""
    hub = InProcHub()
    engine, endpoint = hub.endpoint(ENGINE), hub.endpoint("m0:0")
    spec = WorkerSpec("m0:0", "r0", "colocated", 0, 1, (0, 3), 0, 1, "m0:0", None, (0, 2), "cpu")
    cfg = WorkerConfig(spec, (ReplicaSpec("r0", "colocated", ((spec,),)),), str(model_dirs["llama"]), "float32",
                       256, 16, ("127.0.0.1", 1), LinkSecurity(b"s" * 32), None)
    calls = []

    def capture_all(runner):
        calls.append((list(engine._inbox.queue), torch.is_inference_mode_enabled()))
        return runner.graph_note

    monkeypatch.setattr(StepRunner, "capture_all", capture_all)
    Worker(cfg, endpoint)
    assert calls == [([], True)]  # once, as the steps run (inference mode), before any message went out
    ready = engine.recv(timeout=1)
    assert ready.kind == "ready" and ready.meta["load"]["graphs"] == "off: no GPU"
    assert ready.meta["load"]["kernels"] in ("native", "torch")  # a GPU's: "triton", or "torch (Triton kernels ...)"


def test_a_worker_captures_decode_graphs_unless_its_tp_all_reduce_cannot_be(model_dirs):
    """A TP group over gloo cannot capture its all-reduce; every other worker captures, a prefill
    replica's too: a failover that has it decode (the last decode replica gone) decodes at pace."""
    from hetserve.runtime.workers.worker import decode_graphs

    def cfg(role, backend="gloo", graphs=True):
        spec = WorkerSpec("m0:0", "r0", role, 0, 1, (0, 3), 0, 1, "m0:0", None, (0, 2), "cuda:0")
        return WorkerConfig(spec, (ReplicaSpec("r0", role, ((spec,),)),), str(model_dirs["llama"]), "bfloat16",
                            256, 16, ("127.0.0.1", 1), LinkSecurity(b"s" * 32), None, backend=backend,
                            cuda_graphs=graphs)
    assert decode_graphs(cfg("prefill"), tp=False) == (True, "")  # a failover may have it decode
    assert decode_graphs(cfg("decode"), tp=False) == (True, "")
    assert decode_graphs(cfg("colocated", "nccl"), tp=True) == (True, "")
    assert decode_graphs(cfg("colocated"), tp=True) == (False, "the TP group's all-reduce cannot be captured: a gloo "
                                                                "all-reduce")
    assert decode_graphs(cfg("decode", graphs=False), tp=False) == (False, "not asked")


def test_a_nccl_tp_group_carries_the_leaders_host_headers_over_gloo(monkeypatch):
    """The leader broadcasts each message's header as host bytes; NCCL moves only CUDA tensors, so
    a group of NCCL alone fails the first message ("No backend type associated with device type cpu")."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import BackendConfig

    from hetserve.runtime.workers.rendezvous import GLOO, BoundStore, init_tp_group

    given = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: given.append(backend))
    store = BoundStore("127.0.0.1")
    for backend in ("nccl", "gloo"):
        init_tp_group(backend, store.address, f"r0/{backend}", 0, 1, "127.0.0.1", 30)
    nccl, gloo = (BackendConfig(dist.Backend(b)).get_device_backend_map() for b in given)
    assert nccl == {"cpu": GLOO, "cuda": "nccl"} and gloo["cpu"] == GLOO


def _handle(n: int) -> list:
    """A CUDA IPC handle's fields as ``share_cuda`` writes them (device, handle, size, offset,
    counter file, counter offset, event, event sync, storage offset)."""
    return [0, b"h%d" % n, 4096, 0, b"/torch_123_456_%d" % n, n, b"e", False, 0]


def _ipc_receiver(monkeypatch):
    from hetserve.runtime.workers.channel_pairs import ChannelPeer
    from hetserve.runtime.workers.device_channel import DeviceChannel

    hub = InProcHub()
    hub.endpoint("a")
    channel = DeviceChannel(hub.endpoint("b"), (ChannelPeer("a", "ipc", "g", 1),), torch.device("cuda", 0))
    channel.expect["kv"] = lambda meta: {"kv": (torch.float32, (2, 4))}
    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        classmethod(lambda cls, name, offset, device=None: released.append((name, offset))))
    return channel, released


def _ipc_header(seq: int, shape: list, handles: list):
    from hetserve.runtime.workers.wire import Message

    msg = Message("kv", {"dc": {"seq": seq, "tensors": [["kv", "float32", shape, 4 * shape[0] * shape[1]]],
                                "ipc": handles}})
    msg.src = "a"
    return msg


def test_an_ipc_transfer_refused_before_it_is_opened_releases_the_senders_allocation(monkeypatch):
    """The sender's share sets its block's counter to 1 and only the receiver lowers it: a header
    refused unopened (a shape other than expected, or one after the channel broke) must lower it,
    or the sender's block stays allocated for its whole life. Malformed handles are left alone."""
    channel, released = _ipc_receiver(monkeypatch)
    assert channel._on_receive(_ipc_header(0, [3, 4], [_handle(7)])) == []  # refused: not the shape expected
    assert released == [(b"/torch_123_456_7", 7)] and channel.stats()["refused"] == 1
    bad = _handle(9)
    bad[5] = 10**6  # a counter offset past the counter file: never written through
    assert channel._on_receive(_ipc_header(1, [2, 4], [_handle(8), bad])) == []  # the channel is broken now
    assert released[1:] == [(b"/torch_123_456_8", 8)]


def test_an_ipc_open_that_fails_midway_releases_only_the_allocations_it_did_not_open(monkeypatch):
    from hetserve.runtime.workers import channel_backends

    _, released = _ipc_receiver(monkeypatch)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda",
                        classmethod(lambda cls, *fields: torch.UntypedStorage(64)))  # opens (a host stand-in)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    specs = [["a", "float32", [2], 8], ["b", "float32", [2], 8]]
    # the first opens; the copy after it needs a GPU and fails, as a device error would
    with pytest.raises(channel_backends.IpcOpenFailed):
        channel_backends.open_ipc([_handle(1), _handle(2)], specs, torch.device("cuda", 0))
    assert released == [(b"/torch_123_456_2", 2)]  # the first is released by its storage when freed


def test_a_stages_worker_time_stops_when_its_gpu_work_is_done_not_when_it_is_queued(monkeypatch):
    """A GPU runs the forward after the host queued it: where the host reads the result next (the
    last stage, a socket send) the clock stops when the GPU is done, not when the work was queued."""
    from hetserve.runtime.workers import worker

    clock = {"now": 1.0}

    class Stream:
        def synchronize(self):
            clock["now"] = 5.0  # the queued forward ran until now

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(worker.time, "perf_counter", lambda: clock["now"])
    gpu = worker._spent({"worker_s": 0.5}, (0.0, 0.0), torch.device("cuda", 0), wait=True)
    assert gpu["worker_s"] == 5.5
    clock["now"] = 1.0
    assert worker._spent({}, (0.0, 0.0), torch.device("cpu"), wait=True)["worker_s"] == 1.0  # a CPU ran it already
    # a stage whose device channel carries the activations on does not hold its host for the GPU
    assert worker._spent({}, (0.0, 0.0), torch.device("cuda", 0), wait=False)["worker_s"] == 1.0


class _Stop(Exception):
    pass


def _plan(devices: list[str]):
    from hetserve.planner.plan import Plan

    return Plan.from_dict({"model": "m", "cluster": "g", "replicas": [
        {"id": f"r{i}", "role": "colocated", "stages": [{"devices": [d], "layers": [0, 2]}]}
        for i, d in enumerate(devices)]})


def _cluster():
    from hetserve.specs.cluster import cluster_from_dict

    return cluster_from_dict({"name": "g", "machines": [{"name": "g", "gpu": "H200", "count": 4}]})


def test_a_plans_devices_take_distinct_gpus_in_the_clusters_order(tmp_path, monkeypatch):
    from hetserve.runtime import engine as engine_mod
    from hetserve.runtime.deployment import local_devices
    from hetserve.runtime.model.make import make_model

    seen = []

    def record(layout, *a):
        seen.append({s.name: s.device for r in layout for st in r.stages for s in st})
        raise _Stop

    monkeypatch.setattr(engine_mod, "kv_capacity", record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(_Stop):
        engine_mod.Engine.from_plan(_plan(["g:1", "g:3"]), _cluster(),
                                    str(make_model(tmp_path / "m", "llama", layers=2, hidden=32, heads=2)))
    assert seen == [{"g:1": "cuda:0", "g:3": "cuda:1"}]
    # fewer GPUs than devices: as even as they go, in the cluster's order
    assert local_devices(["g:3", "g:1", "g:0"], _cluster(), 2) == {"g:0": "cuda:0", "g:1": "cuda:1", "g:3": "cuda:0"}
    assert local_devices(["g:3"], _cluster(), 0) == {"g:3": "cpu"}
    # a pool of two 4-GPU machines run on one 4-GPU box: a plan of four devices takes four GPUs
    from hetserve.specs.cluster import cluster_from_dict

    two = cluster_from_dict({"name": "two", "machines": [{"name": "m0", "gpu": "H200", "count": 4},
                                                          {"name": "m1", "gpu": "H200", "count": 4}],
                            "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.1}}})
    assert local_devices(["m1:1", "m0:1", "m1:0", "m0:0"], two, 4) == {
        "m0:0": "cuda:0", "m0:1": "cuda:1", "m1:0": "cuda:2", "m1:1": "cuda:3"}


def test_a_replan_that_drops_a_device_leaves_every_kept_worker_on_its_gpu(monkeypatch):
    """Running on cuda:0-2, a re-plan that drops g:1 and adds g:3 keeps g:0 and g:2 where their
    workers are and puts g:3 on the GPU nobody holds (cuda:3), not beside a running worker."""
    from types import SimpleNamespace

    from hetserve.errors import PlanError
    from hetserve.runtime import elastic
    from hetserve.runtime.deployment import build_layout
    from hetserve.runtime.model.config import llama_arch

    arch = llama_arch(hidden=32, heads=2, ffn=64, layers=2, vocab=64)
    now = build_layout(_plan(["g:0", "g:1", "g:2"]), _cluster(), arch, {f"g:{i}": f"cuda:{i}" for i in range(3)})
    seen = []

    def record(plan, cluster, arch, device_of, source):
        seen.append(device_of)
        raise _Stop

    monkeypatch.setattr(elastic, "build_layout", record)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    engine = SimpleNamespace(loop=SimpleNamespace(layout=now, schedulers={r.id: SimpleNamespace(alive=True)
                                                                          for r in now}),
                             replica_ids_used={r.id for r in now}, arch=arch, _use_cuda=True, devices=None)
    with pytest.raises(_Stop):
        elastic.reconfigure(engine, _plan(["g:0", "g:2", "g:3"]), _cluster())
    assert seen[-1] == {"g:0": "cuda:0", "g:2": "cuda:2", "g:3": "cuda:3"}
    # a dead worker holds nothing: g:1's replica died, so its GPU is the one a new device takes first
    engine.loop.schedulers[now[1].id].alive = False
    with pytest.raises(_Stop):
        elastic.reconfigure(engine, _plan(["g:0", "g:2", "g:3"]), _cluster())
    assert seen[-1] == {"g:0": "cuda:0", "g:2": "cuda:2", "g:3": "cuda:1"}
    # started by a launcher (Ray): its placement, whatever this host's GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    engine.devices = {f"g:{i}": f"cuda:{i}" for i in range(3)}
    with pytest.raises(_Stop):
        elastic.reconfigure(engine, _plan(["g:2"]), _cluster())
    assert seen[-1] == {"g:2": "cuda:2"}
    with pytest.raises(PlanError, match="g:3 were not placed by the launcher"):
        elastic.reconfigure(engine, _plan(["g:2", "g:3"]), _cluster())


def test_a_stage_times_its_gpu_work_unless_its_activations_stay_on_the_device():
    """``DeviceChannel.on_device``: only a working NCCL or IPC channel, for a message big enough to
    take it, keeps the host from reading the activations back; there the stage does not wait for its
    GPU to time itself (a socket, gloo or a broken channel reads them back anyway)."""
    from types import SimpleNamespace

    from hetserve.runtime.workers.device_channel import DeviceChannel, _Link

    ch = DeviceChannel.__new__(DeviceChannel)
    ch.min_bytes = 1024
    ch.links = {p: _Link(SimpleNamespace(peer=p, kind=k)) for p, k in (("a", "nccl"), ("b", "ipc"), ("c", "gloo"))}
    assert [ch.on_device(p, 4096) for p in ("a", "b", "c", "d")] == [True, True, False, False]
    assert ch.on_device("a", 100) is False  # below the channel's minimum: by socket
    ch.links["a"].broken = "timed out"
    assert ch.on_device("a", 4096) is False
