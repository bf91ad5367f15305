"""Workers start by spawn (the default: a fresh interpreter each) or from a fork server
(``start_method="forkserver"`` or ``$HETSERVE_START_METHOD``); both serve the same tokens, and each
runs the way it names (a spawned worker is the engine's child, a forked one the fork server's)."""

from __future__ import annotations

import os

import pytest

from hetserve.planner.plan import Plan
from hetserve.runtime.engine import Engine
from hetserve.runtime.engine_config import START_METHOD_ENV, EngineConfig
from hetserve.runtime.model.make import make_model
from hetserve.runtime.params import SamplingParams

# one worker: each spawned one imports torch afresh (seconds of CPU), and how a worker starts does
# not depend on its neighbours
PLAN = {"model": "tiny", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}
PROMPTS = [[1, 5, 9, 2], [7] * 12]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid"))


def test_the_default_is_spawn_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert EngineConfig().start_method == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert EngineConfig().start_method == "forkserver"
    assert EngineConfig(start_method="spawn").start_method == "spawn"  # a config's own word wins
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=START_METHOD_ENV):
        EngineConfig()


def test_spawned_and_forked_workers_serve_the_same_tokens(tmp_path):
    model = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2)
    tokens = {}
    for method in ("spawn", "forkserver"):
        config = EngineConfig(kv_capacity_tokens=256, start_method=method)
        with Engine.from_plan(Plan.from_dict(PLAN), "demo-cpu", model, config) as eng:
            parents = {_parent(p.pid) for p in eng.procs.values()}
            assert (parents == {os.getpid()}) == (method == "spawn"), (method, parents)
            tokens[method] = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0), timeout=120)
    assert tokens["spawn"] == tokens["forkserver"] and all(len(t) == 6 for t in tokens["spawn"])


def test_a_spawned_worker_imports_neither_the_planners_searches_nor_transformers():
    """What a spawned worker imports before it can load its stage is start-up every worker pays:
    the planner's searches (scipy's solvers, the cost tables) and transformers cost seconds and a
    worker uses neither."""
    import subprocess
    import sys

    heavy = ("hetserve.planner.search", "hetserve.planner.bound", "scipy.optimize", "transformers")
    code = ("import sys, hetserve.runtime.workers.worker_process; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
