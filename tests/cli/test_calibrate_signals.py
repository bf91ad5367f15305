"""SIGTERM during `hetserve calibrate` or `hetserve compare` stops it as Ctrl-C does: the work's own
clean-up runs (the probe or served deployment's workers are stopped) and nothing is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# the measuring function is replaced by one that signals its own process and waits: what the
# command does with the signal is all that is left to see
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import hetserve.calibration.{module} as mod
    from hetserve.cli.main import main

    def measuring(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        finally:
            print("workers stopped", flush=True)

    mod.{function} = measuring
    sys.exit(main({argv!r}))
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["calibrate", "compare"])
def test_sigterm_stops_the_command_as_ctrl_c_does(tmp_path, command):
    from hetserve.runtime.model.make import make_model

    model = make_model(tmp_path / "tiny", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    out = tmp_path / "out.json"
    if command == "calibrate":
        module, function, argv = "calibrate", "calibrate", ["calibrate", "--model", str(model), "-o", str(out)]
    else:
        (tmp_path / "cluster.yaml").write_text("name: cmp\nmachines:\n  - {name: m0, gpu: RTX-4090, count: 1}\n")
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"model": "tiny", "cluster": "cmp", "replicas": [
            {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}))
        out = tmp_path / "cmp"
        module, function, argv = "compare", "compare", ["compare", "--plan", str(plan), "--model", str(model),
                                                        "--cluster", str(tmp_path / "cluster.yaml"), "-o", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", CHILD.format(module=module, function=function, argv=argv)],
                         capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert run.returncode == 130, (run.returncode, run.stderr[-2000:])  # not -15: killed mid-work
    assert "workers stopped" in run.stdout and "interrupted" in run.stderr
    assert not out.exists()
