"""``make demo``'s pool: the bundled ``demo-tiny`` with its slots on this computer's cores."""

from __future__ import annotations

import os

import pytest

from hetserve.demo import HERE_POOL, this_machines_pool, usable_cores
from hetserve.errors import SpecError
from hetserve.specs.cluster import load_cluster


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
    """`python -m hetserve.demo --help` says what the demo does; it does not start its run of minutes."""
    import pytest

    import hetserve.demo as demo

    monkeypatch.setattr(demo, "OUT", tmp_path / "out")
    monkeypatch.setattr(demo, "predict_large_pool", lambda: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as done:
        demo.main(["--help"])
    assert done.value.code == 0 and "make demo" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
