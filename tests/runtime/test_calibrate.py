"""Calibration recovers the efficiency factors that generated its measurements (no engine needed)."""

import statistics

import pytest

from hetserve.cost.analytic import CostModel
from hetserve.cost.efficiency import Efficiency
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.calibration.calibrate import Calibration, fit
from hetserve.calibration.probe_shapes import one_device_cluster
from hetserve.calibration.file import served_efficiency
from hetserve.runtime.model.make import make_model


def _probes_priced_by(cm, spec):
    """What calibrate's probes would measure if ``cm`` were the machine: (prompt TTFTs and decode
    TPOTs on one device, the two-stage and TP 2 probes as ``fit``'s keyword arguments)."""
    lay = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    half = spec.num_layers // 2
    pp = ReplicaLayout((StageLayout((0,), (0, half)), StageLayout((1,), (half, spec.num_layers))))
    tp = ReplicaLayout((StageLayout((0, 1), (0, spec.num_layers)),))
    ttft = {L: cm.ttft(lay, L) for L in (32, 128, 256, 512)}
    tpot = {b: cm.decode_step_time(lay, b, b * (16 + 12)) for b in (1, 4, 16)}
    pp_tpot = {b: cm.decode_step_time(pp, b, b * (16 + 12)) for b in (1, 2)}  # 2: two micro-batches in flight
    return ttft, tpot, dict(pp_ttft={128: cm.ttft(pp, 128)}, pp_tpot=pp_tpot,
                            tp_ttft={128: cm.ttft(tp, 128)}, tp_tpot={1: cm.decode_step_time(tp, 1, 16 + 12)})


def test_fit_recovers_known_efficiency(tmp_path):
    """Every fitted term is recovered from measurements it generated: compute efficiency, the
    fixed cost per iteration, per stage (told apart by the two-stage probes), the share of the
    turn-around that holds the last stage (the two-stage decode of two sequences) and per sequence
    (the decode batch sizes' slope beyond the FLOPs)."""
    model_dir = tmp_path / "m"
    make_model(model_dir, "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    from hetserve.specs.model import load_model

    spec = load_model(model_dir)
    truth = Efficiency(compute=3e-4, iteration_overhead_s=0.004, step_overhead_s=0.0012, seq_overhead_s=0.0003,
                       collective_overhead_s=0.0009, turn_hold=0.9)
    cm = CostModel(one_device_cluster("RTX-4090", 2), spec, truth)
    lay = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    ttft, tpot, probes = _probes_priced_by(cm, spec)
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot, **probes)
    assert cal.efficiency.compute == pytest.approx(3e-4, rel=0.02)
    assert cal.efficiency.iteration_overhead_s == pytest.approx(0.004, rel=0.02)
    assert cal.efficiency.step_overhead_s == pytest.approx(0.0012, rel=0.02)
    assert cal.efficiency.seq_overhead_s == pytest.approx(0.0003, rel=0.02)
    assert cal.efficiency.collective_overhead_s == pytest.approx(0.0009, rel=0.02)
    assert cal.efficiency.turn_hold == pytest.approx(0.9, abs=0.02)
    # no decode probe is bandwidth-bound: memory efficiency stays the default (it prices nothing here)
    assert not cal.memory_bound and cal.efficiency.memory == Efficiency().memory
    assert [(p.stages, p.tp) for p in cal.points] == [(1, 1)] * 7 + [(2, 1)] * 3 + [(1, 2)] * 2
    assert cal.max_abs_error < 0.01
    # each token streamed over HTTP: served TPOT grows by 0.5 ms per sequence beyond the engine's
    served = fit(str(model_dir), "RTX-4090", ttft, tpot, http_tpot={b: t + b * 0.0005 for b, t in tpot.items()})
    assert served.stream_overhead_s == pytest.approx(0.0005, rel=1e-6)
    served.save(tmp_path / "cal.json")
    eff = served_efficiency(tmp_path / "cal.json")
    assert eff.seq_overhead_s == pytest.approx(served.efficiency.seq_overhead_s + 0.0005, rel=1e-9)
    served_model = CostModel(one_device_cluster("RTX-4090"), spec, eff)
    for b, t in tpot.items():  # the simulator's served iteration is the client's TPOT
        assert served_model.decode_step_time(lay, b, b * (16 + 12)) == pytest.approx(t + b * 0.0005, rel=0.02)
    # a KV hand-off measured 3 ms above what the cost model's link gives for that KV
    from hetserve.calibration.probe_shapes import probe_layout
    from hetserve.calibration.file import load_kv_handoff_overhead

    link = CostModel(one_device_cluster("RTX-4090", 2), spec, cal.efficiency).kv_transfer_time(
        probe_layout(spec), probe_layout(spec, first_device=1), 128)
    handed = fit(str(model_dir), "RTX-4090", ttft, tpot, kv_handoff={128: link + 0.003})
    assert handed.kv_handoff_overhead_s == pytest.approx(0.003, rel=1e-3)
    handed.save(tmp_path / "handoff.json")
    assert load_kv_handoff_overhead(tmp_path / "handoff.json") == pytest.approx(0.003, rel=1e-3)
    # without the pipeline probes the fixed cost is one lump per iteration (exact for one stage)
    lump = fit(str(model_dir), "RTX-4090", ttft, tpot).efficiency
    assert lump.step_overhead_s == 0.0 and lump.collective_overhead_s == 0.0
    assert lump.iteration_overhead_s == pytest.approx(0.004 + 0.0012, rel=0.02)
    assert lump.turn_hold is None  # not measured: the cost model's default by host


def test_the_turn_hold_is_the_last_stages_share_where_two_shares_price_the_round(tmp_path):
    """A long turn-around (20 ms, stages of ~2 ms): two micro-batches' round is the last stage's bound
    at the true share 0.6, and the front end's bound, ``2 · (1 − h) · turn``, gives the same round at
    about 0.34. The fit takes the last stage's share: the one whose round grows with the batch, as measured."""
    from hetserve.specs.model import load_model

    model_dir = make_model(tmp_path / "m", "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    spec = load_model(model_dir)
    truth = Efficiency(compute=3e-4, iteration_overhead_s=0.02, step_overhead_s=0.0012, turn_hold=0.6)
    cm = CostModel(one_device_cluster("RTX-4090", 2), spec, truth)
    ttft, tpot, probes = _probes_priced_by(cm, spec)
    two = probes["pp_tpot"][2]
    h_low = 1 - two / (2 * 0.02)  # the front end's bound alone gives the round
    assert 0 < h_low < 0.5
    low = CostModel(one_device_cluster("RTX-4090", 2), spec, Efficiency(
        compute=3e-4, iteration_overhead_s=0.02, step_overhead_s=0.0012, turn_hold=h_low))
    pp = ReplicaLayout((StageLayout((0,), (0, 2)), StageLayout((1,), (2, 4))))
    assert low.decode_step_time(pp, 2, 2 * 28) == pytest.approx(two, rel=1e-9)  # both shares price it
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot, **probes)
    assert cal.efficiency.turn_hold == pytest.approx(0.6, abs=0.02)


@pytest.mark.timeout(240)
def test_fit_recovers_the_multi_row_and_per_byte_collective_costs(tmp_path):
    """A decode step of one sequence cheaper than a line through larger batches says (the GEMV /
    GEMM switch), and a TP prompt dearer per token than the TP decode's fixed cost says (bytes
    through the collectives): both are recovered from measurements they generated, every point
    within 1 %. Fitted without them, the one-sequence decode and the TP pair miss by more than 5 %:
    the shapes of the 12 % misses of the CPU demo's calibrations (docs/cost-model.md)."""
    from hetserve.specs.model import load_model

    model_dir = tmp_path / "m"
    make_model(model_dir, "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    spec = load_model(model_dir)
    one_bytes = spec.num_layers * spec.bytes_per_layer + spec.vocab * spec.hidden * spec.dtype_bytes
    truth = Efficiency(compute=3e-4, iteration_overhead_s=0.004, step_overhead_s=0.0012, seq_overhead_s=0.0001,
                       collective_overhead_s=0.0009, multi_row_s_per_byte=0.0015 / one_bytes,
                       collective_s_per_byte=4e-9)
    ttft, tpot, probes = _probes_priced_by(CostModel(one_device_cluster("RTX-4090", 2), spec, truth), spec)
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot, **probes)
    assert cal.max_abs_error < 0.01
    assert cal.efficiency.multi_row_s_per_byte == pytest.approx(truth.multi_row_s_per_byte, rel=0.05)
    assert cal.efficiency.collective_s_per_byte == pytest.approx(4e-9, rel=0.05)
    assert cal.efficiency.collective_overhead_s == pytest.approx(0.0009, rel=0.05)
    # (the prompt's own fixed cost off too: a free intercept for prompts takes up part of the
    # one-row decode's miss through compute efficiency)
    blind = fit(str(model_dir), "RTX-4090", ttft, tpot, multi_row=False, collective_bytes=False, prompt_fixed=False,
                **probes)
    assert blind.efficiency.multi_row_s_per_byte == 0.0 and blind.efficiency.collective_s_per_byte == 0.0
    worst = {(p.phase, p.size, p.tp): abs(p.error) for p in blind.points}
    assert worst["decode", 1, 1] > 0.05
    assert worst["prefill", 128, 2] > 0.05 and worst["decode", 1, 2] > 0.05


def test_hetserve_calibrate_runs_and_its_file_reproduces_its_table(tmp_path, capsys):
    """`hetserve calibrate` on the real engine and server: the saved efficiency re-predicts every
    printed point, the fit beats the default efficiency on the measurements, and the file says
    where and when it was measured and what a request spends outside the engine."""
    import json

    from hetserve.cli.main import main
    from hetserve.cost.efficiency import load_efficiency
    from hetserve.calibration.file import load_request_overhead
    from hetserve.calibration.probes import DECODE_PROMPT
    from hetserve.specs.model import load_model

    model_dir = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    out = tmp_path / "cal.json"
    code = main(["calibrate", "--model", str(model_dir), "--prompt-lengths", "16,96", "--batch-sizes", "1,6",
                 "--decode-tokens", "6", "--reps", "1", "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(p["phase"], p["size"], p["stages"], p["tp"], p["prompt"]) for p in data["points"]] == [
        ("prefill", 16, 1, 1, 0), ("prefill", 96, 1, 1, 0), ("decode", 1, 1, 1, 16), ("decode", 6, 1, 1, 16),
        ("decode", 4, 1, 1, 256), ("prefill", 96, 2, 1, 0), ("decode", 1, 2, 1, 16), ("decode", 2, 2, 1, 16),
        ("prefill", 96, 1, 2, 0),
        ("decode", 1, 1, 2, 16)]
    assert all(p["measured_s"] > 0 for p in data["points"])
    spec = load_model(model_dir)
    lays = {(1, 1): ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),)),
            (2, 1): ReplicaLayout((StageLayout((0,), (0, 1)), StageLayout((1,), (1, 2)))),
            (1, 2): ReplicaLayout((StageLayout((0, 1), (0, spec.num_layers)),))}
    fitted = CostModel(one_device_cluster("RTX-4090", 2), spec, load_efficiency(out))
    default = CostModel(one_device_cluster("RTX-4090", 2), spec, Efficiency())

    def predict(cm, p):
        lay = lays[p["stages"], p["tp"]]
        return cm.ttft(lay, p["size"]) if p["phase"] == "prefill" else cm.decode_step_time(
            lay, p["size"], p["size"] * (p["prompt"] + 3))
    for p in data["points"]:
        assert predict(fitted, p) == pytest.approx(p["predicted_s"], rel=1e-9)
        assert f"{(p['predicted_s'] - p['measured_s']) / p['measured_s']:+.0%}" in printed  # error per point
    err = lambda cm: sum(abs(predict(cm, p) / p["measured_s"] - 1) for p in data["points"])  # noqa: E731
    assert err(fitted) < err(default)
    assert data["measured_on"]["device"] and data["measured_on"]["cores"] >= 1 and "UTC" in data["measured_on"]["date"]
    assert load_request_overhead(out) == data["runtime"]["request_overhead_s"] >= 0.0
    assert data["runtime"]["stream_overhead_s"] >= 0.0 and "stream overhead" in " ".join(printed.split())
    # the stream fit's data kept (a replay fits its line again) and its fixed part per step
    assert set(data["http_tpot"]) == {str(p["size"]) for p in data["points"] if p["phase"] == "decode" and p["stages"] == 1
                                      and p["tp"] == 1 and p["prompt"] == DECODE_PROMPT}
    assert data["runtime"]["stream_step_overhead_s"] >= 0.0 and "ms per step +" in " ".join(printed.split())
    # the hand-off probe ran (prefill slot -> decode slot): a process hop and a socket cost something
    assert data["runtime"]["kv_handoff_overhead_s"] > 0.0 and "KV hand-off overhead" in " ".join(printed.split())
    flat = " ".join(printed.split())  # rich wraps long lines
    assert data["runtime"]["contention_slowdown"] >= 1.0 and "slow-down beside one more busy process" in flat
    assert "request overhead" in flat and "worst" in flat
    assert "per stage" in flat and "from the two-stage probes" in flat and "per sequence" in flat
    assert 0.0 <= data["efficiency"]["turn_hold"] <= 1.0 and "of the turn-around holds" in flat
    assert "per TP collective" in flat and "per MB it carries (from the TP 2 prompt against the TP 2 decode)" in flat
    assert "matrix products of more than one row" in flat
    # the front end (this process: server, coordinator, client) spent CPU on the HTTP probes, fitted per point
    assert sum(data["runtime"][f"frontend_{k}_cpu_s"] for k in ("request", "step", "token")) > 0.0
    assert len(data["frontend_points"]) >= 2 and "the front end's CPU" in flat and "per engine step" in flat
    assert data["runtime"]["frontend_dispatch_s"] >= 0.0 and "(the GIL probe)" in flat
    # the machine's speed index, read in the rounds, for `compare` to read again when it serves (which
    # median is which: tests/runtime/test_speed_probe.py; on this tiny model their order is noise)
    assert data["speed_probe"]["decode_s"] > 0 and data["speed_probe"]["prefill_s"] > 0
    assert data["speed_probe"]["samples"] >= 8
    assert "machine speed probe" in flat


def test_fit_recovers_attention_efficiency_and_the_front_end_cpu(tmp_path):
    """Attention's own efficiency (a prompt's time per token growing with its length) is recovered
    from prompts of several lengths, and fitting without it leaves the long prompts off; the front
    end's CPU per request, per engine step and per token is recovered from HTTP probes (the first
    round's warm-up dropped by the median) and reaches the simulator's options."""
    from hetserve.calibration.overhead_fit import fit_frontend_cpu
    from hetserve.calibration.file import served_sim_options
    from hetserve.specs.model import load_model

    model_dir = tmp_path / "m"
    make_model(model_dir, "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    spec = load_model(model_dir)
    truth = Efficiency(compute=3e-4, attention=6e-5, iteration_overhead_s=0.004, seq_overhead_s=0.0003)
    cm = CostModel(one_device_cluster("RTX-4090"), spec, truth)
    lay = ReplicaLayout((StageLayout((0,), (0, spec.num_layers)),))
    ttft = {L: cm.ttft(lay, L) for L in (32, 128, 256, 512)}
    tpot = {b: cm.decode_step_time(lay, b, b * (16 + 12)) for b in (1, 4, 16)}
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot)
    assert cal.efficiency.attention == pytest.approx(6e-5, rel=0.05)
    assert cal.max_abs_error < 0.01
    flat = fit(str(model_dir), "RTX-4090", ttft, tpot, attention=False)
    assert flat.efficiency.attention == 0.0 and flat.max_abs_error > 0.02
    # attention at the compute efficiency is the plain roofline (the default, 0, changes nothing)
    same = CostModel(one_device_cluster("RTX-4090"), spec, Efficiency(compute=3e-4, attention=3e-4))
    plain = CostModel(one_device_cluster("RTX-4090"), spec, Efficiency(compute=3e-4))
    assert same.ttft(lay, 512) == pytest.approx(plain.ttft(lay, 512), rel=1e-12)

    # a decode step's attention over its context at its own, lower efficiency (the runtime reads each
    # sequence's KV blocks one by one): recovered from a decode batch at a long context beside the
    # short ones; without it the short-context fit misses the long-context step
    truth_d = Efficiency(compute=3e-4, attention=6e-5, decode_attention=4e-6, iteration_overhead_s=0.004,
                         seq_overhead_s=0.0003)
    cm_d = CostModel(one_device_cluster("RTX-4090"), spec, truth_d)
    tpot_d = {b: cm_d.decode_step_time(lay, b, b * (16 + 12)) for b in (1, 4, 16)}
    long_d = {4: cm_d.decode_step_time(lay, 4, 4 * (256 + 12))}
    ttft_d = {L: cm_d.ttft(lay, L) for L in (32, 128, 256, 512)}
    dec = fit(str(model_dir), "RTX-4090", ttft_d, tpot_d, tpot_long=long_d)
    assert dec.efficiency.decode_attention == pytest.approx(4e-6, rel=0.05) and dec.max_abs_error < 0.01
    assert [p.prompt for p in dec.points if p.phase == "decode"] == [16, 16, 16, 256]
    blind = fit(str(model_dir), "RTX-4090", ttft_d, tpot_d)
    assert blind.efficiency.decode_attention == 0.0
    assert CostModel(one_device_cluster("RTX-4090"), spec, blind.efficiency).decode_step_time(
        lay, 4, 4 * (256 + 12)) < 0.9 * long_d[4]

    req, step, tok = 0.006, 0.0015, 0.0002
    probes = [(4, 4, 4), (1, 24, 24), (4, 24, 96), (16, 24, 384)]
    samples = [(n, k, t, req * n + step * k + tok * t + (0.5 if r == i == 0 else 0.0))  # round 1 warms up
               for r in range(3) for i, (n, k, t) in enumerate(probes)]
    (r_, s_, t_), points = fit_frontend_cpu(samples)
    assert (r_, s_, t_) == pytest.approx((req, step, tok), rel=1e-4)
    assert len(points) == 4 and max(abs(p.error) for p in points) < 1e-4
    assert fit_frontend_cpu(samples[:1]) == ((0.0, 0.0, 0.0), ())
    # the GIL probe's rounds (step delay per unit of the GIL-holding thread's share): their median
    served = fit(str(model_dir), "RTX-4090", ttft, tpot, frontend_cpu=samples, dispatch=[0.012, 0.5, 0.02])
    served.save(tmp_path / "fe.json")
    opts = served_sim_options(tmp_path / "fe.json")
    assert opts["frontend_dispatch_s"] == pytest.approx(0.02, rel=1e-9)
    assert opts["frontend_request_cpu_s"] == pytest.approx(req, rel=1e-4)
    assert opts["frontend_step_cpu_s"] == pytest.approx(step, rel=1e-4)
    assert opts["frontend_token_cpu_s"] == pytest.approx(tok, rel=1e-4)


def test_calibrate_options_turn_the_long_decode_and_speed_probes_off(tmp_path, monkeypatch):
    """``--no-long-decode`` / ``--no-speed-probe`` reach the measurement (both on by default)."""
    import hetserve.calibration.calibrate as calibrate_mod
    from hetserve.cli.main import main

    seen = []

    def stop(model_dir, gpu, **kw):
        seen.append(kw)
        raise SystemExit(7)  # the options were read: nothing to measure

    monkeypatch.setattr(calibrate_mod, "calibrate", stop)
    model_dir = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    for extra in ([], ["--no-long-decode", "--no-speed-probe"]):
        with pytest.raises(SystemExit):
            main(["calibrate", "--model", str(model_dir), *extra])
    assert (seen[0]["long_decode"], seen[0]["speed"]) == (True, True)
    assert (seen[1]["long_decode"], seen[1]["speed"]) == (False, False)


def test_probe_replicas_get_a_kv_pool_sized_to_the_probes_not_the_datasheet(tmp_path, monkeypatch):
    """Every probe replica asks for a KV pool twice the largest probe's tokens. Sized to the GPU's
    datasheet memory instead (what the engine did on CUDA when nothing was asked), the pipeline, TP
    and hand-off probes' slots, which share one real GPU on a one-GPU machine, would not fit on it."""
    from hetserve.calibration import probes as calibration_probes
    from hetserve.runtime.engine import Engine

    configs = []

    class Stop(Exception):
        pass

    def record(plan, cluster, model_dir, config=None, **kw):
        configs.append(config)
        raise Stop  # the engine's config was read: nothing to start

    monkeypatch.setattr(Engine, "from_plan", staticmethod(record))
    model_dir = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    with pytest.raises(Stop):
        calibration_probes.measure(str(model_dir), "H200", prompt_lengths=(32, 128), batch_sizes=(1, 8),
                                   decode_tokens=24, serving=False, speed=False)
    # 4 sequences from 256-token prompts + 24 decoded is the largest probe here
    assert configs[0].kv_capacity_tokens == 2 * 4 * (calibration_probes.LONG_DECODE_PROMPT + 24)


def test_machine_info_names_the_gpu_the_engine_runs_on(monkeypatch):
    """Where CUDA is available the engine's ``device="auto"`` runs there: a calibration's
    ``measured_on`` names that GPU (and keeps the host's CPU), not the CPU alone."""
    import torch

    from hetserve.calibration.probes import machine_info

    cpu = machine_info()["device"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    info = machine_info()
    assert info["device"].startswith("NVIDIA H200 (CUDA") and info["host_cpu"] == cpu and info["gpus"] == 1


def test_the_committed_gpu_calibrations_load_and_say_where_they_were_measured():
    """examples/calibrations/: files `plan/simulate --efficiency` read, each naming its GPU and date."""
    import json
    from pathlib import Path

    from hetserve.cost.efficiency import load_efficiency

    files = sorted((Path(__file__).resolve().parents[2] / "examples" / "calibrations").glob("*/*.json"))
    assert files
    for f in files:
        on = json.loads(f.read_text())["measured_on"]
        assert "(CUDA" in on["device"] and on["date"].startswith("20"), f
        assert load_efficiency(f).iteration_overhead_s > 0  # the fit's fixed cost, read back


def test_streaming_costs_a_fixed_part_per_step_and_a_part_per_sequence():
    """Served − engine TPOT over the batch sizes is a line ``a + b · n`` (non-negative): the step's
    fixed SSE part and each sequence's token; through 0 with one batch size; nothing without any."""
    from hetserve.calibration.overhead_fit import stream_overheads

    engine = {1: 0.0088, 2: 0.0107, 4: 0.0120, 16: 0.0169}
    http = {n: t + 0.0012 + n * 0.00005 for n, t in engine.items()}
    step, seq = stream_overheads(http, engine)
    assert step == pytest.approx(0.0012, rel=1e-6) and seq == pytest.approx(0.00005, rel=1e-6)
    # the line through 0 fitted before: at one sequence 0.12 ms where 1.25 ms is measured
    assert stream_overheads({4: engine[4] + 0.002}, engine) == (0.0, pytest.approx(0.0005))
    assert stream_overheads({n: t - 0.001 for n, t in engine.items()}, engine) == (0.0, 0.0)  # never negative
    assert stream_overheads(None, engine) == (0.0, 0.0)


def test_request_overhead_is_the_paired_difference_where_measured():
    """The request overhead is the median HTTP TTFT less its own prompt step, less the same on the
    engine (paired within each request); the unpaired medians per prompt length only without them."""
    from hetserve.calibration.overhead_fit import request_overhead

    http, engine = {32: 0.050, 128: 0.080}, {32: 0.030, 128: 0.075}  # unpaired: median(20, 5) ms
    assert request_overhead(http, engine) == pytest.approx(0.0125)
    paired = ([0.009, 0.008, 0.010], [0.0002, 0.0003, 0.0001])
    assert request_overhead(http, engine, paired) == pytest.approx(0.009 - 0.0002)
    assert request_overhead(http, engine, ([], [])) == pytest.approx(0.0125)
    assert request_overhead(None, engine, ([0.001], [0.002])) == 0.0  # never negative


@pytest.mark.timeout(180)
def test_calibration_pairs_each_probe_request_with_its_own_prompt_step(tmp_path):
    """On the real engine and server: every TTFT probe, on the engine and through HTTP, yields its
    TTFT less the span of its own prompt step as the coordinator timed it, and HTTP adds the server
    and the client to that. (A single HTTP sample may exceed a length's median HTTP TTFT: no bound
    between them is asserted.)"""
    from hetserve.calibration.probes import measure

    model_dir = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    m = measure(str(model_dir), "RTX-4090", prompt_lengths=(16, 64), batch_sizes=(1,), decode_tokens=4, reps=2,
                pipeline=False, tp=False, handoff=False, speed=False, long_decode=False)
    assert len(m.engine_outside) == len(m.http_outside) == 2 * 2  # per round, one per prompt length
    assert min(m.engine_outside) >= 0.0  # the step lies inside the request's TTFT
    assert statistics.median(m.engine_outside) < 0.5 * min(m.ttft.values())  # ... and is nearly all of it
    assert min(m.http_outside) > 0.0
    assert statistics.median(m.http_outside) > statistics.median(m.engine_outside)


def test_calibrate_says_why_it_measured_no_tp_collective(tmp_path):
    """Without TP 2 probes the collectives cost nothing: the table says whether --no-tp or the
    checkpoint's shape (heads that do not split in two) left them out."""
    import argparse

    from hetserve.cli.commands.calibrate import _collectives

    make_model(tmp_path / "odd", "llama", layers=2, hidden=64, heads=4, kv_heads=1)
    no_points = Calibration("RTX-4090", Efficiency(), ())
    shape = _collectives(no_points, argparse.Namespace(model=str(tmp_path / "odd"), no_tp=False))
    assert "1 KV heads" in shape and "do not all split in two" in shape
    assert _collectives(no_points, argparse.Namespace(model=str(tmp_path / "odd"), no_tp=True)).endswith("--no-tp)")


@pytest.mark.timeout(180)
def test_the_noisy_probes_are_sampled_several_times_a_round_and_priced_by_their_median(tmp_path):
    """On the real engine: the two probes that are two worker processes handing work to each other,
    the noisiest on a shared machine (the TP 2 probe, the two-stage prompt), are taken
    NOISY_SAMPLES_PER_ROUND times in each round, and the calibration's points are the median over
    all of them, not over one a round."""
    from hetserve.calibration.probes import NOISY_SAMPLES_PER_ROUND, measure

    assert NOISY_SAMPLES_PER_ROUND >= 2
    model_dir = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    m = measure(str(model_dir), "RTX-4090", prompt_lengths=(16, 32), batch_sizes=(1,), decode_tokens=4, reps=2,
                serving=False, pipeline=True, handoff=False, speed=False, long_decode=False)
    for key, point in (("tp_ttft", m.tp_ttft[32]), ("tp_tpot", m.tp_tpot[1]), ("pp_ttft", m.pp_ttft[32])):
        samples = m.noisy_rounds[key]
        assert sorted(r for r, _ in samples) == [0] * NOISY_SAMPLES_PER_ROUND + [1] * NOISY_SAMPLES_PER_ROUND, key
        assert point == statistics.median(s for _, s in samples), key
    assert len(m.noisy_rounds) == 3


def test_fit_recovers_a_prompt_steps_own_fixed_cost(tmp_path):
    """A step carrying a prompt that costs each stage 3 ms more than a decode step's fixed costs (the
    CPU demo's prompts sat 1-7 ms above the line the decodes' fixed costs drew) is recovered from
    measurements it generated, on one device and on both stages of the pipeline probe, every point
    within 1 %. Fitted without it, the shortest prompt misses by more than 5 %, as the demo's 32-token
    prompt did (5.6 % low on average over 60 calibrations)."""
    from hetserve.specs.model import load_model

    model_dir = make_model(tmp_path / "m", "llama", layers=4, hidden=128, heads=4, kv_heads=2)
    spec = load_model(model_dir)
    truth = Efficiency(compute=3e-4, iteration_overhead_s=0.004, step_overhead_s=0.0012, seq_overhead_s=0.0003,
                       collective_overhead_s=0.0009, turn_hold=0.9, prompt_step_overhead_s=0.003)
    ttft, tpot, probes = _probes_priced_by(CostModel(one_device_cluster("RTX-4090", 2), spec, truth), spec)
    cal = fit(str(model_dir), "RTX-4090", ttft, tpot, **probes)
    assert cal.max_abs_error < 0.01
    assert cal.efficiency.prompt_step_overhead_s == pytest.approx(0.003, rel=0.05)
    assert cal.efficiency.step_overhead_s == pytest.approx(0.0012, rel=0.05)
    assert cal.efficiency.iteration_overhead_s == pytest.approx(0.004, rel=0.05)
    blind = fit(str(model_dir), "RTX-4090", ttft, tpot, prompt_fixed=False, **probes)
    assert blind.efficiency.prompt_step_overhead_s == 0.0
    assert abs(next(p for p in blind.points if (p.phase, p.size, p.stages) == ("prefill", 32, 1)).error) > 0.05
