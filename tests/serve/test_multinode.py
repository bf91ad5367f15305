"""One plan served across a real multi-node Ray cluster, on this one machine.

Three Ray nodes, each on its own loopback address (127.0.0.2 head, 127.0.0.3, 127.0.0.4), each
advertising one machine of a cluster file whose machines carry those addresses. One module-scoped
cluster serves every test here (Ray's object store kept small); the node-loss test runs last, as it
kills a node's raylet.

- a prefill/decode plan (prefill on m0, decode split over m1 and m2) and an asymmetric pipeline
  (TP 2 across m0 and m1, then TP 1 on m2): greedy tokens equal transformers';
- every socket hetserve opens listens on its own node's address — workers' endpoints and gloo
  devices, the engine's endpoint and TP rendezvous store — and none on all interfaces;
- killing one node's raylet mid-load loses no request the other replica can serve.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

import ray  # noqa: E402  (make test installs the ray extra: a missing ray must fail, not skip)

NODES = {"m0": "127.0.0.2", "m1": "127.0.0.3", "m2": "127.0.0.4"}  # machine -> its Ray node's address
HEAD = NODES["m0"]
CLUSTER_YAML = "name: loopback-pool\nmachines:\n" + "".join(
    f"  - {{name: {m}, gpu: RTX-4090, count: 2, address: {ip}}}\n" for m, ip in NODES.items()) + \
    "network:\n  intra_site: {bandwidth_gbps: 10, latency_ms: 0.1}\n"
LAYERS = 4
# p0 -> d0: prefill on m0, decode's two stages on m1 and m2 (the KV crosses nodes, re-split by layer).
# c0: asymmetric colocated pipeline, TP 2 across nodes m0 + m1 for layer 0, then TP 1 on m2.
SHAPES_PLAN = {"model": "tiny", "cluster": "loopback-pool", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["m0:0"], "layers": [0, LAYERS]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["m1:0"], "layers": [0, 2]},
                                              {"devices": ["m2:0"], "layers": [2, LAYERS]}]},
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:1", "m1:1"], "layers": [0, 1]},
                                                 {"devices": ["m2:1"], "layers": [1, LAYERS]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
# two interchangeable replicas on different nodes; m2's node is the one that leaves
FAILOVER_PLAN = {"model": "tiny", "cluster": "loopback-pool", "replicas": [
    {"id": "r1", "role": "colocated", "stages": [{"devices": ["m1:0"], "layers": [0, LAYERS]}]},
    {"id": "r2", "role": "colocated", "stages": [{"devices": ["m2:0"], "layers": [0, LAYERS]}]}]}
PROMPTS = [list(b"Hello, many machines!"), [5, 9, 2], list(range(40, 80)), list(b"A"),
           list(b"The quick brown fox jumps over the lazy dog."), [300, 7, 7, 7, 301, 12]]
MAX_NEW = 16
FAILOVER_NEW = 300  # node-loss test: outputs long enough to outlive the node (see the test)
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                      "health_check_timeout_ms": 300, "health_check_failure_threshold": 3}


# ----------------------------------------------------------------------------- without a cluster


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_no_endpoint_listens_on_all_interfaces(wildcard, tmp_path, model, capsys):
    from hetserve.cli.main import main as cli
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.transport import SocketTransport

    with pytest.raises(ValueError, match="every interface"):
        SocketTransport("w", LinkSecurity.fresh(), host=wildcard)
    with pytest.raises(ValueError, match="every interface"):
        EngineConfig(host=wildcard)
    if wildcard:  # the CLI: one line, exit 2, before anything starts
        plan = tmp_path / "plan.json"
        Plan.from_dict(FAILOVER_PLAN).save(plan)
        (tmp_path / "pool.yaml").write_text(CLUSTER_YAML)
        assert cli(["serve", "--plan", str(plan), "--cluster", str(tmp_path / "pool.yaml"), "--model", str(model),
                    "--port", "0", "--backend", "ray", "--advertise-address", wildcard]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--advertise-address" in err[0], err
    # the HTTP fronts too: serve's API and route's
    serve = ["serve", "--plan", str(tmp_path / "plan.json"), "--cluster", str(tmp_path / "pool.yaml"),
             "--model", str(model), "--port", "0"]
    for argv in (serve, ["route", "--backends", "http://127.0.0.1:9", "--port", "0"]) if wildcard else ():
        assert cli(argv + ["--host", wildcard]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--host" in err[0] and "every interface" in err[0], err


@pytest.mark.parametrize("spelling", ["0", "0x0", "00.0.0.0", "::0", "0:0:0:0:0:0:0:0", "[::]", "*"])
def test_every_spelling_of_every_interface_is_refused(spelling):
    """The resolver reads these as 0.0.0.0 or ::; a list of the usual spellings alone let them through."""
    from hetserve.runtime.workers.rendezvous import check_bind_address

    with pytest.raises(ValueError, match="every interface"):
        check_bind_address(spelling, "--host")


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.0.0.5", "node-a.lan", "fe80::1%eth0"])
def test_one_address_or_a_host_name_is_taken_as_written(address):
    from hetserve.runtime.workers.rendezvous import check_bind_address

    assert check_bind_address(f" {address} ", "--host") == address


def test_a_machine_address_its_ray_node_does_not_have_is_named():
    from hetserve.errors import RuntimeFailure
    from hetserve.runtime.workers.ray_backend import _check_addresses

    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.6", "Resources": {"hetserve_machine_b0": 1000.0}}]
    _check_addresses("lab", {"b0": "10.0.0.6"}, nodes)
    _check_addresses("lab", {"b0": "box-b0.lab"}, nodes)  # a host name: the worker's bind checks it
    with pytest.raises(RuntimeFailure, match=r"machine b0 has address 10\.0\.0\.7.*node-ip-address 10\.0\.0\.7"):
        _check_addresses("lab", {"b0": "10.0.0.7"}, nodes)


def test_workers_on_gpu_nodes_get_a_gpu_and_cpu_slots_none():
    from hetserve.errors import RuntimeFailure
    from hetserve.runtime.workers.ray_backend import _devices
    import yaml

    from hetserve.specs.cluster import cluster_from_dict

    cluster = cluster_from_dict(yaml.safe_load(CLUSTER_YAML))
    nodes = [{"Alive": True, "Resources": {"hetserve_machine_m0": 1000.0, "GPU": 2.0}},
             {"Alive": True, "Resources": {"hetserve_machine_m1": 1000.0, "hetserve_machine_m2": 1000.0}}]
    assert _devices(cluster, "auto", nodes) == {"m0:0": "cuda:0", "m0:1": "cuda:1", "m1:0": "cpu", "m1:1": "cpu",
                                                "m2:0": "cpu", "m2:1": "cpu"}
    assert set(_devices(cluster, "cpu", nodes).values()) == {"cpu"}
    with pytest.raises(RuntimeFailure, match=r"\['m1', 'm2'\] advertise no GPU"):
        _devices(cluster, "cuda", nodes)


# ----------------------------------------------------------------------------- on a 3-node Ray cluster


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A 3-node Ray cluster on 127.0.0.2-4 and this driver joined to its head; torn down after."""
    from ray.cluster_utils import Cluster

    from hetserve.runtime.workers.ray_session import RaySession, machine_resource
    from hetserve.specs.cluster import load_cluster

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_TMPDIR")}
    # Ray's socket paths must stay under 107 bytes, which pytest's tmp folders can exceed: a short
    # private folder of this module, removed at the end
    ray_tmp = tempfile.mkdtemp(prefix="hsmn-", dir="/tmp")
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=ray_tmp)
    small = {"num_cpus": 1, "object_store_memory": 78 * 1024 * 1024}  # Ray's minimum object store
    nodes, session, rc = {}, None, None
    try:
        path = tmp_path_factory.mktemp("pool") / "cluster.yaml"
        path.write_text(CLUSTER_YAML)
        cluster = load_cluster(str(path))
        rc = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": HEAD, "resources": {machine_resource("m0"): 1000}, "include_dashboard": False,
            "_system_config": FAST_HEALTH_CHECKS, **small})
        nodes["m0"] = rc.head_node
        for m in ("m1", "m2"):
            nodes[m] = rc.add_node(node_ip_address=NODES[m], resources={machine_resource(m): 1000}, **small)
        rc.wait_for_nodes()
        session = RaySession.start(cluster, address=rc.address, node_ip_address=HEAD)
        yield type("Pool", (), {"cluster": cluster, "path": path, "nodes": nodes, "ray": rc})
    finally:
        if session is not None:
            session.close()
        if rc is not None:
            rc.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hetserve.runtime.model.make import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "llama", layers=LAYERS, hidden=64, heads=4,
                      kv_heads=2, max_positions=512, seed=3)


def _hf_greedy(model, max_new: int, stop_at_eos: bool = True) -> list[list[int]]:
    """transformers' greedy ``generate`` (new tokens only, stopping at EOS unless told not to), one
    prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    if not stop_at_eos:  # the engine's ignore_eos: EOS is an ordinary token and generation goes on
        hf.generation_config.eos_token_id = None
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(model):
    return _hf_greedy(model, MAX_NEW)


@pytest.fixture(scope="module")
def shapes_engine(pool, model):
    """The two plan shapes in one engine, over shaped links with MoLink scheduling (as ``serve
    --transmission molink --shape-links``); each node's workers report their link counters over the transport."""
    from hetserve.planner.plan import Plan
    from hetserve.runtime.engine_config import EngineConfig
    from hetserve.runtime.links.factory import LinkSchedulerFactory
    from hetserve.runtime.workers.ray_backend import start_ray_engine
    from tests.runtime.test_port_range import free_run

    before = _listeners(os.getpid())  # the driver's own Ray sockets
    links = LinkSchedulerFactory(pool.cluster, "molink", shape=True)
    # hetserve's own listeners take their ports from a range (--port-range), on each node alike
    config = EngineConfig(kv_capacity_tokens=1024, port_range=free_run(8))
    engine = start_ray_engine(Plan.from_dict(SHAPES_PLAN), pool.cluster, model, config, link_scheduler=links)
    engine.driver_ray_listeners, engine.links = before, links
    yield engine
    engine.shutdown()
    links.close()


@pytest.mark.long  # three Ray nodes take ~30 s to start: make test-long
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("replica", ["p0", "c0"], ids=["prefill-decode", "asymmetric-pipeline"])
def test_plan_shapes_across_three_nodes_match_transformers(shapes_engine, reference, replica, wait_until):
    from hetserve.runtime.params import SamplingParams

    handles = [shapes_engine.submit(p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), replica=replica)
               for p in PROMPTS]
    assert [h.result(timeout=120) for h in handles] == reference
    procs = shapes_engine.procs
    assert {p.machine for p in procs.values()} == set(NODES)
    assert all(p.host == NODES[p.machine] for p in procs.values())
    # the traffic that crossed nodes went over the cluster's shaped links (activations; KV for p0 -> d0)
    kind, src, dst = ("kv", "m0:0", "m1:0") if replica == "p0" else ("prefill", "m0:1", "m2:1")

    def crossed():
        link = {(s.src, s.dst): s for s in shapes_engine.link_stats()}.get((src, dst))
        return link is not None and link.bytes_sent[kind] > 0 and link.bandwidth < float("inf")

    assert wait_until(crossed, 10), f"no shaped {kind} traffic {src} -> {dst}"


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_socket_listens_on_its_nodes_address_only(shapes_engine):
    actors = {a["Pid"]: a["Address"]["Port"] for a in ray._private.state.actors().values() if a["State"] == "ALIVE"}
    seen = {}
    for name, p in shapes_engine.procs.items():
        ours = {(ip, port) for ip, port in _listeners(p.pid) if port != actors[p.pid]}  # minus Ray's own server
        assert ours, f"worker {name} listens nowhere"
        assert {ip for ip, _ in ours} == {NODES[p.machine]}, f"worker {name} on {p.machine}: {sorted(ours)}"
        seen[name] = len(ours)
    # TP ranks also listen for gloo (the TP 2 stage spans m0 and m1): bound to their node too
    assert seen["m0:1"] >= 2 and seen["m1:1"] >= 2
    driver = _listeners(os.getpid()) - shapes_engine.driver_ray_listeners
    assert shapes_engine.transport.address[0] == HEAD
    assert len(driver) >= 2 and {ip for ip, _ in driver} == {HEAD}, sorted(driver)  # endpoint + TP store
    # the engine's endpoint and TP store, each worker's endpoint: inside --port-range (gloo's are the OS's)
    ports = shapes_engine.config.port_range
    ours = [shapes_engine.transport.address, shapes_engine.workers._store.address,
            *shapes_engine.workers.addresses.values()]
    assert all(ports.lo <= tuple(a)[1] <= ports.hi for a in ours), ours
    assert {(a[0], a[1]) for a in ours[:2]} <= driver


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_node_that_leaves_mid_load_loses_no_request(pool, model, shapes_engine, wait_until):
    from hetserve.planner.plan import Plan
    from hetserve.runtime.params import SamplingParams
    from hetserve.serve.launch import ServeOptions, build

    shapes_engine.shutdown()  # its workers on m2's node would die with it; this test needs the memory anyway
    # through the server's launcher, as `hetserve serve --backend ray --ray-address … --advertise-address …`
    deployment = build(ServeOptions(plan=Plan.from_dict(FAILOVER_PLAN), cluster=pool.cluster, model_dir=str(model),
                                    backend="ray", ray_address=pool.ray.address, advertise_address=HEAD,
                                    kv_capacity_tokens=1024, max_num_seqs=3))
    engine = deployment.engine
    assert engine.transport.address[0] == HEAD and ray.is_initialized()
    # r2 must still be generating when its worker goes (up to 0.5 s after the raylet): no EOS stops,
    # and 300-token outputs of which only two fit r2's KV pool at once, so r2 has hundreds of
    # decode steps left when it is killed, however fast the machine
    reference = _hf_greedy(model, FAILOVER_NEW, stop_at_eos=False)
    try:
        params = SamplingParams(max_tokens=FAILOVER_NEW, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(p, params) for p in PROMPTS]
        assert wait_until(lambda: engine.stats().get("replicas", {}).get("r2", {}).get("running", 0) > 0
                          and any(h.tokens for h in handles), 60)
        pool.nodes["m2"].kill_raylet()
        t0 = time.monotonic()
        got = [h.result(timeout=120) for h in handles]
        assert got == reference
        assert wait_until(lambda: not engine.stats()["replicas"]["r2"]["alive"], 30)
        stats = engine.stats()
        assert stats["reruns"] >= 1 and stats["failed"] == 0  # r2 held requests when its node left
        print(f"node loss: {stats['deaths'][0]['why']}; {stats['reruns']} request(s) re-run; last request done "
              f"{time.monotonic() - t0:.1f} s after the raylet was killed")
        assert engine.procs["m2:0"].exitcode not in (None, 0)
        assert "node" in (engine.procs["m2:0"].cause or "")
    finally:
        deployment.close()
    assert ray.is_initialized()  # the pool's session is not the server's to end


def _listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on (``ss``); "*" for all interfaces."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if f"pid={pid}," not in line:
            continue
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        host = host.strip("[]").removeprefix("::ffff:")
        found.add(("*" if host in ("*", "0.0.0.0", "::") else host, int(port)))
    return found
