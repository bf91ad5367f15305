"""Runtime pieces without worker processes: model stages, attention metadata, TP slicing, KV pools and
hand-off pieces, admission, batching, sampling, routing, tiny checkpoints (transports:
``test_transport_units.py``)."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from hetserve.runtime.kv_cache import BlockManager
from hetserve.runtime.params import SamplingParams
from hetserve.runtime.sampling import sample
from hetserve.runtime.workers.wire import Message

# ----------------------------------------------------------------------------- model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_plain_stage_mixed_batches_match_transformers(arch, model_dirs, hf_reference):
    """Whole model in one process: prefills joining a running decode batch give generate's tokens."""
    from hetserve.runtime.model.attention import build_attn_meta
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.loader import build_stage

    d = model_dirs[arch]
    cfg = ArchConfig.from_dir(d)
    stage = build_stage(cfg, d, (0, cfg.num_layers), has_embed=True, has_head=True)
    prompts = [list(b"abcdefg"), [9, 8, 7], list(range(40, 75))]
    n = 10
    expected = hf_reference(d, prompts, n)
    bs, kv = 4, [(torch.zeros(256, cfg.num_kv_heads, cfg.head_dim), torch.zeros(256, cfg.num_kv_heads, cfg.head_dim))
                 for _ in range(cfg.num_layers)]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(3)]
    out: list[list[int]] = [[], [], []]
    joined = {0: 0, 1: 2, 2: 4}  # request -> step at which it arrives
    with torch.inference_mode():
        for step in range(n + 4):
            rows = [i for i in range(3) if joined[i] <= step and len(out[i]) < n]
            if not rows:
                continue
            starts = [0 if not out[i] else len(prompts[i]) + len(out[i]) - 1 for i in rows]
            feeds = [prompts[i] if not out[i] else [out[i][-1]] for i in rows]
            meta = build_attn_meta(starts, [len(f) for f in feeds], [tables[i] for i in rows], bs)
            h = stage.embed(torch.tensor([t for f in feeds for t in f]), meta.positions)
            h = stage(h, kv, meta)
            tokens = stage.logits(h[meta.last_token]).argmax(-1).tolist()
            for i, t in zip(rows, tokens):
                out[i].append(t)
    for got, want in zip(out, expected):
        assert got[:len(want)] == want


def test_attn_meta_for_a_mixed_batch():
    from hetserve.runtime.model.attention import build_attn_meta

    # seq 0: decode at position 5 (blocks [3, 1]); seq 1: prefill of 3 tokens (block [2])
    m = build_attn_meta([5, 0], [1, 3], [[3, 1], [2]], block_size=4, grouped=False)
    assert m.positions.tolist() == [5, 0, 1, 2]
    assert m.slot_mapping.tolist() == [1 * 4 + 1, 8, 9, 10]
    assert m.last_token.tolist() == [0, 3]
    (one,) = m.parts  # one packed call over every token, in order
    assert one.tokens is None and one.max_query_len == 3
    assert one.block_tables.tolist() == [[3, 1], [2, 0]] and one.context_lens.tolist() == [6, 3]
    assert one.query_start_loc.tolist() == [0, 1, 4]
    # grouped (the plain-torch kernels' default): the decode is not padded to the prompt's 3 rows
    decodes, prompts = build_attn_meta([5, 0], [1, 3], [[3, 1], [2]], block_size=4, grouped=True).parts
    assert decodes.tokens.tolist() == [0] and prompts.tokens.tolist() == [1, 2, 3]
    assert decodes.max_query_len == 1 and decodes.context_lens.tolist() == [6]
    assert prompts.query_start_loc.tolist() == [0, 3] and prompts.block_tables.tolist() == [[2, 0]]
    # one kind of sequence: one part over every token, in order
    (only,) = build_attn_meta([5, 2], [1, 1], [[3, 1], [2]], block_size=4).parts
    assert only.tokens is None and only.max_query_len == 1 and only.context_lens.tolist() == [6, 3]


@pytest.mark.parametrize("grouped", [True, False])
def test_a_mixed_step_attends_as_its_sequences_would_alone(grouped):
    """Attention of a step mixing decodes and prompts (any order), in one packed call or in parts,
    gives each token what a step of that sequence alone gives."""
    import torch

    from hetserve.runtime.model.attention import build_attn_meta, paged_attention

    torch.manual_seed(0)
    H, Hkv, D, bs = 4, 2, 8, 4
    seqs = [(6, 1, [0, 1]), (0, 5, [2, 3]), (9, 1, [4, 5, 6]), (3, 2, [7, 8])]  # (start, q_len, blocks)
    T = sum(q for _, q, _ in seqs)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    kc0, vc0 = torch.randn(64, Hkv, D), torch.randn(64, Hkv, D)  # earlier tokens' K/V
    kc, vc = kc0.clone(), vc0.clone()
    meta = build_attn_meta([s for s, _, _ in seqs], [n for _, n, _ in seqs], [b for _, _, b in seqs], bs,
                           grouped=grouped)
    assert len(meta.parts) == (2 if grouped else 1)
    mixed = paged_attention(q, k, v, kc, vc, meta, 0.3)
    at = 0
    for s, n, b in seqs:
        kc1, vc1 = kc0.clone(), vc0.clone()
        alone = paged_attention(q[at:at + n], k[at:at + n], v[at:at + n], kc1, vc1,
                                build_attn_meta([s], [n], [b], bs), 0.3)
        torch.testing.assert_close(mixed[at:at + n], alone)
        at += n
    slots = meta.slot_mapping.long()
    torch.testing.assert_close(kc[slots], k)  # every new token's K/V in its slot
    torch.testing.assert_close(vc[slots], v)


def test_tp_slices_split_heads_and_keep_row_bias_once():
    from hetserve.runtime.model.tp import shard_of

    col = shard_of("column", "weight", (8, 4), rank=1, world=2)
    assert col.slices[0] == slice(4, 8)
    row = shard_of("row", "weight", (4, 8), rank=1, world=2)
    assert row.slices[1] == slice(4, 8)
    assert shard_of("row", "bias", (4,), rank=0, world=2).zero is False
    assert shard_of("row", "bias", (4,), rank=1, world=2).zero is True
    assert shard_of(None, "weight", (4,), rank=1, world=2).slices == (slice(None),)


# ----------------------------------------------------------------------------- KV


def test_block_manager_admission():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.can_allocate(64) and not bm.can_allocate(65)
    a = bm.allocate(20)
    assert len(a) == 2 and bm.num_free_blocks == 2
    assert not bm.can_allocate(40)
    with pytest.raises(ValueError):
        bm.allocate(40)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert bm.fits_ever(64) and not bm.fits_ever(65)
    # a second free of one table, or a free into a released pool, never puts a block in twice
    b = bm.allocate(30)
    bm.free(b)
    bm.free(b)
    c = bm.allocate(64)
    assert sorted(c) == [0, 1, 2, 3] and bm.num_free_blocks == 0
    bm.release_all()
    bm.free(c)
    assert sorted(bm.free_blocks) == [0, 1, 2, 3] and bm.num_used_blocks == 0


def test_kv_pool_roundtrip_and_slots():
    from hetserve.runtime.workers.kv_pool import KVPool, slots_of

    assert slots_of([3, 0], 6, 4).tolist() == [12, 13, 14, 15, 0, 1]
    pool = KVPool(num_layers=3, num_slots=32, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    slots = slots_of([5, 2], 7, 4)
    piece = torch.randn(2, 2, 7, 1, 4)
    pool.write(slice(1, 3), slice(1, 2), slots, piece)
    assert torch.equal(pool.read(slice(1, 3), slice(1, 2), slots), piece)
    assert pool.k[0].abs().sum() == 0 and pool.k[:, :, 0].abs().sum() == 0


def _replica(rid, role, stages, kv_heads=2):
    from hetserve.runtime.layout import ReplicaSpec, WorkerSpec

    out = []
    for s, (devices, layers) in enumerate(stages):
        t = len(devices)
        out.append(tuple(WorkerSpec(d, rid, role, s, len(stages), layers, k, t, devices[0], None,
                                    (k * kv_heads // t, (k + 1) * kv_heads // t), "cpu")
                         for k, d in enumerate(devices)))
    return ReplicaSpec(rid, role, tuple(out))


@pytest.mark.parametrize("src_stages,dst_stages", [
    ([(("a", "b"), (0, 3))], [(("c",), (0, 2)), (("d",), (2, 3))]),  # TP2 -> TP1 + TP1
    ([(("a",), (0, 1)), (("b",), (1, 3))], [(("c", "d"), (0, 3))]),  # PP2 -> TP2
])
def test_kv_transfers_cover_every_layer_and_head_once(src_stages, dst_stages):
    from hetserve.runtime.layout import kv_transfers

    src, dst = _replica("p", "prefill", src_stages), _replica("d", "decode", dst_stages)
    pieces = kv_transfers(src, dst)
    for w in dst.workers:
        cells = [(layer, h) for p in pieces if p.dst == w.name
                 for layer in range(*p.layers) for h in range(*p.heads)]
        want = [(layer, h) for layer in range(*w.layers) for h in range(*w.kv_heads)]
        assert sorted(cells) == sorted(want)


# ----------------------------------------------------------------------------- scheduling


def _seq(i, prompt_len, max_tokens=4):
    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.sequence import Sequence

    return Sequence(i, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0, frozenset(), RequestHandle(i, prompt_len))


def test_continuous_batching_admits_while_kv_fits_and_decodes_every_step():
    from hetserve.runtime.scheduler import ReplicaScheduler

    sched = ReplicaScheduler("c0", "colocated", BlockManager(4, 16), num_stages=1)
    waiting = deque([_seq(1, 20, 10), _seq(2, 20, 10), _seq(3, 5, 5)])
    step = sched.next_step(waiting)
    assert [s.id for s in step] == [1, 2]  # 30 tokens = 2 blocks each; the third does not fit
    sched.start(1, step)
    assert not sched.can_start_step() and sched.next_step(waiting) == []
    for s in sched.complete(1):
        s.num_cached, s.output = 20, [5]
        sched.ready.append(s)
    assert [s.id for s in sched.next_step(waiting)] == [1, 2]  # still no room for 3: FCFS waits
    sched.release(step[0])
    sched.ready.clear()
    assert [s.id for s in sched.next_step(waiting)] == [3]


def test_chunked_prefill_feeds_chunks_in_admission_order_and_skips_prompts_in_flight():
    """Chunked prefill on a two-stage replica: every prompt that fits is admitted, chunks fill the
    step's 8 tokens with the decodes counted, a prompt in flight gets no second chunk, and an
    idle prompt can be dropped (an abort) without touching the steps in flight."""
    from hetserve.runtime.scheduler import ReplicaScheduler

    sched = ReplicaScheduler("c0", "colocated", BlockManager(64, 16), num_stages=2, prefill_mode="chunked",
                             chunk_tokens=8)
    a, b, c = _seq(1, 5, 4), _seq(2, 12, 4), _seq(3, 30, 4)
    first = sched.next_step(deque([a, b, c]))
    assert [s.id for s in first] == [1, 2] and [s.next_input()[1] for s in first] == [[1] * 5, [1] * 3]
    assert [s.id for s in sched.prefilling] == [1, 2, 3]  # all three admitted (KV fits), 3 waits for room
    sched.start(1, first)
    second = sched.next_step(deque())  # 1 and 2 are in flight: only 3 may feed a chunk
    assert [(s.id, s.next_input()) for s in second] == [(3, (0, [1] * 8))]
    sched.start(2, second)
    for s in sched.complete(1):
        s.num_cached += len(s.next_input()[1])
    assert sched.chunk_done(a) and not sched.chunk_done(b)  # 1 prefilled whole; 2 has 9 tokens left
    a.output = [7]
    sched.ready.append(a)
    assert sched.idle(b) and not sched.idle(c)  # 3 is still in flight
    sched.drop(b)
    assert [s.id for s in sched.prefilling] == [3] and sched.num_running == 2  # a ready, c in flight
    with pytest.raises(ValueError, match="simulator what-if"):
        ReplicaScheduler("c0", "colocated", BlockManager(4, 16), num_stages=1, prefill_mode="prefill_first")


def test_micro_batches_split_decoders_over_pipeline_stages():
    from hetserve.runtime.scheduler import ReplicaScheduler

    sched = ReplicaScheduler("d0", "decode", BlockManager(64, 16), num_stages=2)
    sched.ready.extend(_seq(i, 4) for i in range(6))
    first = sched.next_step(deque())
    sched.start(1, first)
    second = sched.next_step(deque())
    sched.start(2, second)
    assert len(first) == 3 and len(second) == 3
    assert sched.next_step(deque()) == []


# ----------------------------------------------------------------------------- sampling and routing


def test_sampler_greedy_seeded_and_top_p():
    logits = torch.randn(3, 50)
    assert sample(logits, [(0.0, 1.0, 0, 0)] * 3).tolist() == logits.argmax(-1).tolist()
    a = sample(logits, [(1.0, 1.0, 42, i) for i in range(3)])
    b = sample(logits, [(1.0, 1.0, 42, i) for i in range(3)])
    assert torch.equal(a, b)
    assert sample(logits, [(1.0, 1e-9, 1, 0)] * 3).tolist() == logits.argmax(-1).tolist()
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_plan_routes_follow_plan_weights_and_skip_dead_replicas():
    """The runtime's route choice is the simulator's policy (flow: smooth weighted round robin)."""
    from hetserve.planner.plan import Plan
    from hetserve.policies.base import ReplicaState, RequestInfo
    from hetserve.runtime.routing import PlanRoutes

    plan = Plan.from_dict({"model": "tiny", "cluster": "c", "replicas": [
        {"id": i, "role": role, "stages": [{"devices": [f"m0:{k}"], "layers": [0, 3]}]}
        for k, (i, role) in enumerate([("p0", "prefill"), ("px", "prefill"), ("d0", "decode"), ("d1", "decode")])],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 0.75}, {"from": "p0", "to": "d1", "weight": 0.25}]})
    states = {d: ReplicaState(d, "decode", 0, 0, 0, 0.0, 0, 0, 100) for d in ("d0", "d1")}
    info = RequestInfo(1, 0.0, 10, 5.0)
    r = PlanRoutes(plan)
    picks = [r.choose(info, "p0", ["d0", "d1"], states, 0.0) for _ in range(8)]
    assert picks.count("d0") == 6 and picks.count("d1") == 2
    assert {r.choose(info, "p0", ["d1"], states, 0.0) for _ in range(3)} == {"d1"}
    assert {r.choose(info, "px", ["d0", "d1"], states, 0.0) for _ in range(4)} == {"d0", "d1"}  # no routes: even
    busy = {"d0": ReplicaState("d0", "decode", 5, 9, 0, 900.0, 0, 0, 100), "d1": states["d1"]}
    load = PlanRoutes(plan, "load")
    assert load.choose(info, "p0", ["d0", "d1"], busy, 0.0) == "d1"  # the load policy reads the snapshot


# ----------------------------------------------------------------------------- tiny checkpoints


def test_make_model_tokenizer_round_trips_text(model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dirs["llama"]))
    text = "héllo wörld 🙂\n\ttabs"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)


def test_make_model_cli(tmp_path):
    from hetserve.cli.main import main
    from hetserve.runtime.model.config import ArchConfig

    assert main(["make-model", "--arch", "opt", "--layers", "2", "--hidden", "32", "--heads", "2",
                 "-o", str(tmp_path / "m")]) == 0
    cfg = ArchConfig.from_dir(tmp_path / "m")
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size) == ("opt", 2, 32)
    assert main(["make-model", "--arch", "llama", "--heads", "3", "-o", str(tmp_path / "bad")]) == 2


def test_runtime_snapshot_counts_tokens_context_and_per_replica_queues():
    """The fields the simulator fills: tokens (not requests) outstanding, real context, each replica
    its own queue (not the global one), decode replicas the hand-offs routed to them."""

    from hetserve.runtime.handle import RequestHandle
    from hetserve.runtime.scheduler import ReplicaScheduler
    from hetserve.runtime.sequence import Sequence
    from hetserve.runtime.snapshot import replica_snapshots, state_from_stats

    def seq(i, n, max_tokens, out=0, pinned=None):
        s = Sequence(i, list(range(n)), SamplingParams(max_tokens=max_tokens), 0, frozenset(), RequestHandle(i, n),
                     pinned=pinned)
        s.output = [1] * out
        s.num_cached = n + max(0, out - 1) if out else 0
        return s

    c0 = ReplicaScheduler("c0", "colocated", BlockManager(64, 16), num_stages=1)
    c1 = ReplicaScheduler("c1", "colocated", BlockManager(64, 16), num_stages=1)
    p0 = ReplicaScheduler("p0", "prefill", BlockManager(64, 16), num_stages=1)
    d0 = ReplicaScheduler("d0", "decode", BlockManager(64, 16), num_stages=1)
    c0.ready.extend([seq(1, 100, 50, out=10), seq(2, 20, 8, out=3)])
    c0.pinned.append(seq(3, 30, 40, pinned="c0"))
    c1.pinned.extend([seq(4, 7, 5, pinned="c1")])
    p0.start(9, [seq(5, 64, 10)])
    moving = seq(6, 12, 30, out=1)
    moving.replica, moving.dst = "p0", "d0"
    d0.ready.append(seq(7, 40, 20, out=5))
    c0.blocks.allocate(150 + 28)
    snap = replica_snapshots({"c0": c0, "c1": c1, "p0": p0, "d0": d0}, [moving])
    s = state_from_stats("c0", {"role": "colocated", "state": snap["c0"]})
    assert (s.queued_requests, s.running_requests, s.queued_prefill_tokens) == (1, 2, 30)
    assert s.outstanding_tokens == 30 + 40 + (50 - 10) + (8 - 3)  # prompt to prefill + tokens still to come
    assert s.context_tokens == (100 + 10) + (20 + 3)
    assert (s.kv_used_tokens, s.kv_capacity_tokens) == (12 * 16, 64 * 16)
    assert snap["c1"]["queued_requests"] == 1 and snap["c1"]["outstanding_tokens"] == 12
    assert snap["p0"]["running_requests"] == 1 and snap["p0"]["outstanding_tokens"] == 64
    assert snap["d0"]["queued_requests"] == 1  # the hand-off routed to it
    assert snap["d0"]["outstanding_tokens"] == (30 - 1) + (20 - 5)
    assert snap["d0"]["context_tokens"] == 45


def test_worker_step_loop_outlives_a_link_error():
    """A send to a peer that died (a decode worker gone mid hand-off) makes the transport post a
    ``link_error`` into the worker's own inbox; the step loop must skip it, not die on it (the
    engine re-runs the dead peer's work on this very worker)."""
    from types import SimpleNamespace

    from hetserve.runtime.workers.worker import Worker

    inbox = deque([Message("link_error", {"peer": "m1:0", "error": "ConnectionResetError()"}),
                   Message("shutdown")])
    worker = Worker.__new__(Worker)  # only the step loop is under test: no model, no sockets
    worker.spec = SimpleNamespace(is_leader=True)
    worker.tp = None
    worker.transport = SimpleNamespace(recv=lambda timeout=None: inbox.popleft() if inbox else None)
    worker.run()  # returns at "shutdown"
    assert not inbox


@pytest.mark.parametrize("gpus,real", [(1, False), (2, True)])
def test_plan_devices_sharing_a_gpu_get_capped_kv_pools(tmp_path, monkeypatch, gpus, real):
    """On CUDA a pool is sized to the cluster file's memory only where each plan device has a GPU of
    its own. Two plan devices on one GPU (more of them than the host has GPUs) would each size a pool
    to a whole GPU's memory, and two such pools do not fit on one: they are capped as on CPU."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime import engine as engine_mod
    from hetserve.runtime.model.make import make_model
    from hetserve.specs.cluster import cluster_from_dict

    seen = []

    class Stop(Exception):
        pass

    def record(layout, cluster, arch, dtype, config, memory_is_real):
        seen.append((sorted({s.device for r in layout for st in r.stages for s in st}), memory_is_real))
        raise Stop

    monkeypatch.setattr(engine_mod, "kv_capacity", record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    model = make_model(tmp_path / "m", "llama", layers=2, hidden=32, heads=2)
    cluster = cluster_from_dict({"name": "g", "machines": [{"name": "g", "gpu": "H200", "count": 2}]})
    plan = Plan.from_dict({"model": "m", "cluster": "g", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["g:0"], "layers": [0, 2]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["g:1"], "layers": [0, 2]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]})
    with pytest.raises(Stop):
        engine_mod.Engine.from_plan(plan, cluster, str(model))
    assert seen == [([f"cuda:{i}" for i in range(gpus)], real)]


def test_two_machines_run_on_one_box_share_its_gpus_and_their_pools_are_capped():
    """A pool of two 2-GPU machines served on one 2-GPU host: m0:0 and m1:0 are one cuda:0 here. On
    two hosts (a launcher placed them) each machine's cuda:0 is its own GPU."""
    from hetserve.runtime.engine_config import memory_is_real
    from hetserve.specs.cluster import cluster_from_dict

    two = cluster_from_dict({"name": "two", "machines": [{"name": "m0", "gpu": "H200", "count": 2},
                                                          {"name": "m1", "gpu": "H200", "count": 2}],
                            "network": {"intra_site": {"bandwidth_gbps": 100, "latency_ms": 0.1}}})
    placed = {"m0:0": "cuda:0", "m0:1": "cuda:1", "m1:0": "cuda:0", "m1:1": "cuda:1"}
    assert memory_is_real(placed, two, True, one_host=True) is False
    assert memory_is_real(placed, two, True, one_host=False) is True
