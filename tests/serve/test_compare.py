"""`hetserve compare` end to end: the live server and the simulator on the same requests."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(240)
def test_compare_serves_simulates_and_writes_table_and_cdfs(tmp_path, capsys):
    from hetserve.cli.main import main
    from hetserve.runtime.make_model import make_model

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    (tmp_path / "cluster.yaml").write_text("name: cmp\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 2}\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": "tiny", "cluster": "cmp", "replicas": [
        {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]},
        {"id": "d0", "role": "decode", "stages": [{"devices": ["m0:1"], "layers": [0, 2]}]}],
        "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}))
    out = tmp_path / "out"
    code = main(["compare", "--plan", str(plan), "--model", str(model), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--workload-class", "LPLD", "--rate", "200", "-n", "6", "--max-input", "48", "--max-output", "6",
                 "--kv-admission", "paged", "-o", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "compare.json").read_text())
    table = data["table"]
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        for s in ("mean", "p50", "p90", "p99"):
            row = table[f"{m}.{s}"]
            assert row["served"] > 0 and row["simulated"] > 0
            assert row["ratio"] == pytest.approx(row["simulated"] / row["served"])
    assert table["throughput_tokens_per_s"]["served"] > 0
    # the simulator ran with the server's KV pools and batching knobs, not its own
    assert set(data["info"]["kv_pools"]) == {"p0", "d0"} and data["info"]["token_budget"] == 2048
    assert data["info"]["kv_admission"] == {"served": "paged", "simulated": "paged"}  # both sides (an ample pool: nothing is pre-empted)
    assert data["info"]["load_avg_1m"] and "uncalibrated" in data["info"]["simulated_source"]
    assert data["info"]["other_cores_busy"] >= 0.0  # what the neighbours took from the served side
    assert "other processes on this machine kept" in printed
    assert (out / "compare_cdf.png").stat().st_size > 10_000
    assert "TTFT p99" in printed and "output tokens/s" in printed
    # the engine steps of both sides: the same prompt tokens through p0, and 5 decode tokens per
    # request on d0 (the first comes from the prefill), however each side batched them
    steps = data["info"]["steps"]
    prompts = sum(len_ for len_ in data["info"]["prompt_tokens"])
    for side in ("served", "simulated"):
        pre, dec = steps[side]["p0 prompt"], steps[side]["d0 decode"]
        assert pre["steps"] * pre["prompt_tokens"] == pytest.approx(prompts)
        assert dec["steps"] * dec["decodes"] == pytest.approx(6 * 5)
        assert dec["step_ms"] > 0 and dec["token_ms"] > 0
    assert steps["served"]["d0 decode"]["model_ms"] > 0
    assert set(data["info"]["cores_busy"]) == {"front end", "m0:0", "m0:1"}
    assert all(0 <= v <= 8 for v in data["info"]["cores_busy"].values())
    assert "engine steps" in printed
