"""Every bundled demo plan (``examples/plans/*.json``) is valid for the tiny model its README entry
builds, and ``hetserve serve`` runs it with both backends: one greedy completion through the
official ``openai`` client returns exactly the tokens the engine produces for the same prompt,
and the Ray backend (every worker an actor on its machine's node) returns the local backend's
tokens. One private loopback Ray session is shared by all plans (module-scoped) to keep time down.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
PLANS_DIR = ROOT / "examples" / "plans"
README = ROOT / "examples" / "README.md"

# The make-model arguments of each plan's checkpoint (``-o <plan.model>`` is appended); the README
# entry of every plan must show exactly this command.
RECIPES = {
    "asym-colocated.json": "--arch llama --layers 4 --hidden 64 --heads 4 --kv-heads 2",
    "disagg-tp2-to-pp2.json": "--arch opt --layers 4 --hidden 64 --heads 4",
    "demo-tiny-disagg.json": "--arch llama --layers 8 --hidden 256 --heads 4 --kv-heads 1 --ffn 768",
}
PLAN_FILES = sorted(p.name for p in PLANS_DIR.glob("*.json"))
PROMPTS = ["the quick brown fox", "hello", "x" * 40, "Once upon a time, 1 2 3"]
MAX_TOKENS = 8


def test_every_bundled_plan_has_a_recipe_in_the_readme():
    assert PLAN_FILES, "no bundled plans in examples/plans"
    assert set(PLAN_FILES) == set(RECIPES), "a plan without a make-model recipe here (or the reverse)"
    from hetserve.planner.plan import Plan

    readme = README.read_text()
    for name in PLAN_FILES:
        plan = Plan.load(PLANS_DIR / name)
        assert f"examples/plans/{name}" in readme, name
        assert f"hetserve make-model {RECIPES[name]} -o {plan.model}" in readme, name


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{plan file: (Plan, checkpoint folder)}``, each checkpoint built by its recipe and validated."""
    from hetserve.cli.main import main as cli
    from hetserve.planner import validate_plan
    from hetserve.planner.plan import Plan
    from hetserve.specs.cluster import load_cluster
    from hetserve.specs.model import load_model

    root = tmp_path_factory.mktemp("bundled-models")
    out = {}
    for name in PLAN_FILES:
        plan = Plan.load(PLANS_DIR / name)
        model_dir = root / plan.model  # the folder's name is the model's name the plan must match
        if not model_dir.exists():
            assert cli(["make-model", *shlex.split(RECIPES[name]), "-o", str(model_dir)]) == 0
        validate_plan(plan, load_cluster(plan.cluster), load_model(model_dir))
        out[name] = (plan, model_dir)
    return out


@pytest.fixture(scope="module")
def ray_session(models):
    """One private one-node Ray on loopback advertising every machine of the bundled pools; servers
    started while it is up join it (and leave it running), and it is shut down after the module."""
    import ray  # make test installs the ray extra: a missing ray must fail, not skip
    from hetserve.runtime.workers.ray_session import machine_resource
    from hetserve.specs.cluster import load_cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mp.setenv("RAY_AUTH_MODE", "disabled")
    ray_tmp = tempfile.mkdtemp(prefix="hsray-", dir="/tmp")  # Ray's socket paths must stay short
    mp.setenv("RAY_TMPDIR", ray_tmp)
    machines = {m for plan, _ in models.values() for m in load_cluster(plan.cluster).machines}
    try:
        ray.init(num_cpus=2, resources={machine_resource(m): 1000.0 for m in machines}, include_dashboard=False,
                 _temp_dir=ray_tmp, log_to_driver=False, _node_ip_address="127.0.0.1")
        yield ray
    finally:
        ray.shutdown()
        mp.undo()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _serve_once(plan, model_dir, backend):
    """Serve ``plan``; return [(engine tokens, openai completion, engine tokens as text)] for greedy requests."""
    import openai

    from hetserve.runtime.params import SamplingParams
    from hetserve.serve.launch import ServeOptions, start_server

    opts = ServeOptions(plan=plan, model_dir=str(model_dir), backend=backend)
    with start_server(opts) as srv:
        dep = srv.deployment
        if backend == "ray":
            from hetserve.runtime.workers.ray_backend import RayWorkerProcess

            assert all(isinstance(p, RayWorkerProcess) for p in dep.engine.procs.values())
            assert {p.machine for p in dep.engine.procs.values()} == {d.split(":")[0] for d in plan.devices}
        codec = dep.coordinator.codec
        tokens = dep.engine.generate([codec.encode(p) for p in PROMPTS],
                                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), timeout=60)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        done = [client.completions.create(model=plan.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                for p in PROMPTS]
        return [(t, d, codec.decode(t), codec) for t, d in zip(tokens, done)]


def _check(results):
    """The openai client's completion is the engine's greedy output: same token count, same text, and
    where the output bytes are valid UTF-8 (the byte tokenizer's text is then one-to-one with the
    tokens) the text re-encodes to exactly the engine's tokens."""
    exact = 0
    for prompt, (tokens, done, text, codec) in zip(PROMPTS, results):
        assert 1 <= len(tokens) <= MAX_TOKENS
        assert done.usage.prompt_tokens == len(prompt.encode())  # byte tokenizer
        assert done.usage.completion_tokens == len(tokens)
        assert done.choices[0].text == text
        body = [t for t in tokens if t < 256]  # ids 0-255 are bytes; 256+ are <bos> <eos> <pad>
        try:
            bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert codec.encode(done.choices[0].text) == body
        exact += 1
    return exact


_LOCAL_TOKENS: dict[str, list[int]] = {}


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", PLAN_FILES)
def test_bundled_plan_serves_with_local_backend(models, name):
    plan, model_dir = models[name]
    results = _serve_once(plan, model_dir, "local")
    assert _check(results) >= 1, "no output was valid UTF-8, so the re-encoding check never ran"
    _LOCAL_TOKENS[name] = [r[0] for r in results]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", PLAN_FILES)
def test_bundled_plan_serves_with_ray_backend(models, ray_session, name):
    plan, model_dir = models[name]
    results = _serve_once(plan, model_dir, "ray")
    assert ray_session.is_initialized()  # the server joined the shared session and left it running
    _check(results)
    if name in _LOCAL_TOKENS:  # the local test ran in this session: the same greedy tokens
        assert [r[0] for r in results] == _LOCAL_TOKENS[name]
