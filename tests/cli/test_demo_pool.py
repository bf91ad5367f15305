"""``make demo``'s pool: the bundled ``demo-tiny`` with its slots on this computer's cores."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hetserve.errors import SpecError
from hetserve.specs.cluster import load_cluster

# the demo is a script beside the examples, not part of the library: load it from its file
_spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[2] / "examples" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)
HERE_POOL, this_machines_pool, usable_cores = demo.HERE_POOL, demo.this_machines_pool, demo.usable_cores


def test_the_demo_pool_puts_every_slot_on_this_computers_usable_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    path = this_machines_pool(tmp_path)
    here, bundled = load_cluster(str(path)), load_cluster("demo-tiny")
    assert here.name == HERE_POOL != bundled.name
    assert [d.name for d in here.devices] == [d.name for d in bundled.devices]
    # one host, the cores this process may use (its affinity, not the machine's count)
    assert {(d.cpu_cores, d.cpu_host) for d in here.devices} == {(3, "this-computer")}
    assert "3 cores" in path.read_text()


def test_usable_cores_falls_back_to_the_cpu_count_without_an_affinity_mask(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert usable_cores() == 5


def test_a_plan_made_on_the_demo_pool_does_not_fall_back_to_the_bundled_preset():
    # the plan records the pool's name; without --cluster the commands load that name, which is no preset
    with pytest.raises(SpecError):
        load_cluster(HERE_POOL)


def test_demo_help_prints_usage_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """`python examples/demo.py --help` says what the demo does; it does not start its run of minutes."""
    monkeypatch.setattr(demo, "OUT", tmp_path / "out")
    monkeypatch.setattr(demo, "predict_large_pool", lambda: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as done:
        demo.main(["--help"])
    assert done.value.code == 0 and "make demo" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_calibration_prices_every_cpu_slot_so_planning_the_demo_pool_with_it_warns_of_nothing(tmp_path, capsys):
    """The demo pool's "L4" and "RTX-4090" slots are CPU slots, all priced at the calibration's GPU
    peaks: a calibration made as another type (here H100) is not applied to other GPUs' peaks."""
    import json

    from hetserve.cli.main import main

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "H100-SXM-80G", "efficiency": {}}))
    model = tmp_path / "tiny-llama"  # a config is all the planner reads
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}))
    args = ["plan", "--cluster", str(this_machines_pool(tmp_path)), "--model", str(model), "--algorithm", "uniform",
            "--quiet", "--efficiency", str(cal), "-o", str(tmp_path / "plan.json")]
    assert main(args) == 0
    assert "calibrated as" not in capsys.readouterr().out
