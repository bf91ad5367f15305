"""The server's policies are built on the simulator's context, with the same names and defaults."""

from __future__ import annotations

import httpx
import pytest

from hetserve.cli.main import build_parser
from hetserve.cli.policy_options import route_of
from hetserve.planner.plan import Plan
from hetserve.policies.placement import DEFAULT_PLACEMENT, make_placement
from hetserve.policies.routing import DEFAULT_ROUTE
from hetserve.policies.transmission import DEFAULT_TRANSMISSION
from hetserve.serve.launch import ServeOptions, policy_context
from hetserve.sim.simulator import SimOptions
from hetserve.specs.cluster import load_cluster

TWO = {"model": "tiny", "cluster": "demo-cpu", "algorithm": "manual", "replicas": [
    {"id": f"r{i}", "role": "colocated", "stages": [{"devices": [f"m0:{i}"], "layers": [0, 4]}]} for i in range(2)]}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from hetserve.runtime.model.make import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2,
                      max_positions=256)


def test_simulate_serve_and_compare_share_option_names_and_defaults():
    parser = build_parser()
    sim = parser.parse_args(["simulate", "--plan", "p.json", "--workload", "azure-conv"])
    serve = parser.parse_args(["serve", "--plan", "p.json", "--model", "m"])
    compare = parser.parse_args(["compare", "--plan", "p.json", "--model", "m"])
    for args in (sim, serve, compare):
        assert args.placement == DEFAULT_PLACEMENT and route_of(args) == DEFAULT_ROUTE
    # read as the default, in one place (None: a command can tell an option given from one left out)
    assert sim.route is None and serve.route is None
    assert sim.transmission is None and serve.transmission is None
    opts = ServeOptions(plan="p.json", model_dir="m")
    assert (opts.placement, opts.route, opts.transmission) == (SimOptions().placement, SimOptions().route,
                                                               SimOptions().transmission)
    assert (opts.placement, opts.route, opts.transmission) == (DEFAULT_PLACEMENT, DEFAULT_ROUTE, DEFAULT_TRANSMISSION)
    # the old spelling still names the same option
    assert parser.parse_args(["serve", "--plan", "p", "--model", "m", "--router", "jsq"]).placement == "jsq"


class RecordingPredictor:
    """An output-length predictor (``policies.predictor`` protocol) that records how it is called."""

    def __init__(self):
        self.predicted, self.observed = [], []

    def predict(self, request_id: int, input_tokens: int, generated_tokens: int = 0) -> float:
        self.predicted.append((request_id, input_tokens, generated_tokens))
        return 4.0

    def observe(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        self.observed.append((request_id, input_tokens, output_tokens))


def test_serving_under_aladdin_with_a_predictor_uses_its_protocol(tiny_model, tmp_path):
    from hetserve.serve.app import create_app
    from hetserve.serve.coordinator import Coordinator
    from hetserve.serve.fake import ByteCodec, FakeBackend
    from hetserve.serve.server import ServerThread

    plan = Plan.from_dict(TWO)
    predictor = RecordingPredictor()
    opts = ServeOptions(plan=plan, cluster="demo-cpu", model_dir=str(tiny_model), placement="aladdin",
                        predictor=predictor, slo_ttft_s=5.0, slo_tpot_s=0.5, policy_options={"gamma": 0.9})
    ctx = policy_context(opts, plan, load_cluster("demo-cpu"))
    # what the simulator's context holds: the cost model, every replica's layout, the SLOs and knobs
    assert ctx.cost is not None and set(ctx.layouts) == {"r0", "r1"}
    assert ctx.predictor is predictor and ctx.options == {"gamma": 0.9} and ctx.slo.tpot_s == 0.5

    coordinator = Coordinator(FakeBackend(replicas=2), ByteCodec(), "tiny", placement=make_placement("aladdin", ctx),
                              predictor=predictor)
    server = ServerThread(create_app(coordinator))
    try:
        for prompt in ("hello", "the quick brown fox"):
            r = httpx.post(server.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
            r.raise_for_status()
    finally:
        server.stop()
    # predict(request id, prompt tokens, generated so far = 0); observe(the same id, prompt, output)
    assert [p[1:] for p in predictor.predicted] == [(5, 0), (19, 0)]
    assert [o[1:] for o in predictor.observed] == [(5, 3), (19, 3)]
    assert [p[0] for p in predictor.predicted] == [o[0] for o in predictor.observed]


def test_the_body_limit_option_reaches_the_server_options():
    from hetserve.serve.limits import DEFAULT_MAX_BODY_BYTES

    parser = build_parser()
    assert parser.parse_args(["serve", "--plan", "p", "--model", "m"]).max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert parser.parse_args(["serve", "--plan", "p", "--model", "m", "--max-body-bytes", "1000"]).max_body_bytes == 1000
    assert ServeOptions(plan="p", model_dir="m").max_body_bytes == DEFAULT_MAX_BODY_BYTES
