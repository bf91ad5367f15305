"""``--port-range LO-HI`` (``EngineConfig.port_range``): the runtime's own listeners — the engine's
endpoint, its TP rendezvous store, every worker's endpoint — take the first free port of the range;
a range with none left is one line naming the option and the range; a bad range is refused."""

from __future__ import annotations

import contextlib
import socket

import pytest

from hetserve.errors import RuntimeFailure
from hetserve.runtime.workers.rendezvous import PortRange, listen_socket

FIRST = 20000  # below the OS's ephemeral ports (32768 up on Linux): gloo's own sockets stay out


def free_run(n: int, start: int = FIRST) -> PortRange:
    """``n`` consecutive ports free on loopback right now."""
    port = start
    while port + n <= 32768:
        with contextlib.ExitStack() as held:
            try:
                for p in range(port, port + n):
                    held.enter_context(socket.create_server(("127.0.0.1", p)))
                return PortRange(port, port + n - 1)
            except OSError:
                port = p + 1
    raise RuntimeError(f"no {n} consecutive free ports from {start}")


@pytest.mark.parametrize("text", ["5-3", "abc", "0-10", "1-65536", "5", "-5", "20000-"])
def test_a_bad_range_says_what_is_expected(text):
    with pytest.raises(ValueError, match="LO-HI with 1 <= LO <= HI <= 65535"):
        PortRange.parse(text)


@pytest.mark.parametrize("value", [5, [1, 2, 3], (1,), {"lo": 1, "hi": 2}, b"ab"])
def test_a_range_of_the_wrong_shape_says_what_is_expected(value):
    from hetserve.runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match=r"expected LO-HI with 1 <= LO <= HI <= 65535 .* or a pair \(LO, HI\), got "):
        PortRange.of(value)
    with pytest.raises(ValueError, match="expected LO-HI"):
        EngineConfig(port_range=value)


def test_the_bounds_are_checked_in_one_place_with_one_message():
    for lo, hi in ((9, 3), (0, 10), (1, 65536)):
        with pytest.raises(ValueError) as built:
            PortRange(lo, hi)
        with pytest.raises(ValueError) as parsed:
            PortRange.parse(f"{lo}-{hi}")
        with pytest.raises(ValueError) as paired:
            PortRange.of((lo, hi))
        assert str(built.value) == str(parsed.value) == str(paired.value) == (
            f"expected {PortRange.EXPECTED}, got '{lo}-{hi}'")


@pytest.mark.parametrize("ports", [None, PortRange(FIRST, FIRST + 9)])
def test_an_address_not_on_this_machine_is_blamed_on_the_host_not_the_range(ports):
    with pytest.raises(RuntimeFailure) as info:  # 192.0.2.1: a documentation address, no machine's own
        listen_socket("192.0.2.1", ports, "endpoint w0")
    msg = str(info.value)
    assert msg.startswith("endpoint w0 cannot listen on 192.0.2.1 (") and "--port-range" not in msg
    assert msg.endswith("it must be an address of this machine") and "\n" not in msg


def test_the_options_refuse_a_bad_range_in_one_line(capsys):
    from hetserve.cli.main import main
    from hetserve.runtime.engine_config import EngineConfig

    for bad in ("5-3", "abc", "70000-70001"):
        assert main(["serve", "--plan", "p.json", "--model", "m", "--port-range", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "argument --port-range: expected LO-HI" in err and repr(bad) in err
    with pytest.raises(ValueError, match="LO-HI"):
        EngineConfig(port_range="9-1")
    assert EngineConfig(port_range="20000-20009").port_range == PortRange(20000, 20009)


def test_each_listener_takes_the_first_free_port_and_a_full_range_is_one_line():
    ports = free_run(3)
    taken = socket.create_server(("127.0.0.1", ports.lo))  # someone else's
    try:
        a = listen_socket("127.0.0.1", ports, "endpoint a")
        b = listen_socket("127.0.0.1", ports, "endpoint b")
        assert (a.getsockname()[1], b.getsockname()[1]) == (ports.lo + 1, ports.lo + 2)
        with pytest.raises(RuntimeFailure) as info:
            listen_socket("127.0.0.1", ports, "endpoint c")
        msg = str(info.value)
        assert msg.startswith(f"--port-range {ports}: no free port left on 127.0.0.1 for endpoint c")
        assert "\n" not in msg
        a.close()
        assert listen_socket("127.0.0.1", ports).getsockname()[1] == ports.lo + 1  # freed: taken again
    finally:
        taken.close()
        b.close()


def test_engine_and_workers_listen_inside_the_range(model_dirs, cluster_file, plans):
    """TP 2 then TP 1: the engine's endpoint, the TP store and three worker endpoints, five ports."""
    from hetserve.runtime.engine import Engine, EngineConfig
    from hetserve.runtime.params import SamplingParams

    from .conftest import colocated_plan

    ports = free_run(5)
    with Engine.from_plan(colocated_plan(), cluster_file, model_dirs["llama"],
                          EngineConfig(kv_capacity_tokens=512, port_range=ports)) as eng:
        used = [tuple(a) for a in (eng.transport.address, eng.workers._store.address, *eng.workers.addresses.values())]
        assert len(used) == 5 and len(set(used)) == 5
        assert all(host == "127.0.0.1" and ports.lo <= port <= ports.hi for host, port in used), used
        assert len(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3), timeout=60)[0]) == 3


def test_a_range_too_small_for_the_plan_is_one_line_naming_it(model_dirs, cluster_file):
    from hetserve.runtime.engine import Engine, EngineConfig

    from .conftest import colocated_plan

    ports = free_run(4)  # one short of the five listeners
    with pytest.raises(RuntimeFailure) as info:
        Engine.from_plan(colocated_plan(), cluster_file, model_dirs["llama"],
                         EngineConfig(kv_capacity_tokens=512, port_range=ports, start_timeout_s=60))
    assert f"--port-range {ports}: no free port left on 127.0.0.1 for endpoint m0:" in str(info.value)


def test_serve_options_carry_the_range_to_the_engine_and_its_workers(model_dirs, cluster_file, plans):
    from hetserve.serve.launch import ServeOptions, build

    ports = free_run(2)  # the engine's endpoint and one worker's
    deployment = build(ServeOptions(plan=plans.single(), cluster=str(cluster_file), model_dir=str(model_dirs["llama"]),
                                    kv_capacity_tokens=512, port_range=str(ports)))
    try:
        engine = deployment.engine
        assert engine.config.port_range == ports
        used = {tuple(a)[1] for a in (engine.transport.address, *engine.workers.addresses.values())}
        assert used == {ports.lo, ports.hi}
    finally:
        deployment.close()
