"""A figure's source names what priced it: a simulation's the plan's GPU types (not a pool's
unused ones), capacity's the one GPU type it sizes, and a calibration of another GPU type is
warned of in simulate as in plan."""

import json

import yaml

from hetserve.cli.main import main

from .plans import single

# an A100 box beside an L40 box: the A100 is fitted from measurements, the L40 transferred
MIXED = {"name": "test", "machines": [{"name": "m0", "gpu": "A100-SXM-80G", "count": 4, "site": "s0"},
                                      {"name": "m1", "gpu": "L40", "count": 4, "site": "s1"}],
         "network": {"inter_site": {"bandwidth_gbps": 100, "latency_ms": 1}}}


def _simulate(tmp_path, *extra):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(MIXED))
    single({"c0": ["m0:0"]}).save(tmp_path / "plan.json")  # the A100 only: the L40s time nothing
    return main(["simulate", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "c.yaml"),
                 "--workload", "azure-conv", "--limit", "5", "--no-progress", "--json", *extra])


def test_a_simulations_source_names_only_the_plans_gpu_types(tmp_path, capsys):
    assert _simulate(tmp_path) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["timings"]["pricing"] == s["run"]["pricing"] == {"A100-SXM-80G": "fitted"}
    assert "L40" not in s["timings"]["source"]


def test_simulate_warns_of_a_calibration_of_another_gpu_type(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "H200", "efficiency": {},
                               "measured_on": {"device": "NVIDIA H200", "date": "2026-11-28"}}))
    assert _simulate(tmp_path, "--efficiency", str(cal)) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"warning: {cal} was calibrated as H200 (measured on NVIDIA H200, 2026-11-28); this pool has " \
           "A100-SXM-80G: its efficiency factors are applied to them unchanged" in err
    cal.write_text(json.dumps({"gpu": "A100-SXM-80G", "efficiency": {}}))
    assert _simulate(tmp_path, "--efficiency", str(cal)) == 0
    assert "calibrated as" not in capsys.readouterr().err


def test_capacity_names_only_the_gpu_type_it_sizes(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(MIXED))
    assert main(["capacity", "--cluster", str(tmp_path / "c.yaml"), "--model", "llama-2-7b", "--workload",
                 "sharegpt", "--rates", "5,20", "--slo-ttft", "1", "--slo-tpot", "0.05", "--method", "fluid"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("cost model, A100-SXM-80G: fitted from measurements of this GPU") == 2, out
    assert "L40" not in out
