"""Session-wide test settings."""

import dataclasses
import fcntl
import gc
import hashlib
import os
import pickle
import sys
from pathlib import Path

import pytest


@pytest.fixture
def roofline(monkeypatch):
    """Real GPUs priced by the roofline (``Efficiency``'s fractions of datasheet peaks), not the
    fitted kernel model: for tests whose subject is not pricing (host contention, the search's
    moves, the bound's structure) and whose figures and pools were chosen under the roofline."""
    from hetserve.cost import analytic

    monkeypatch.setattr(analytic, "_KERNELS_BY_DEFAULT", False)


@pytest.fixture(scope="session", autouse=True)
def _fewer_full_collections():
    """A test process holds a large heap (torch, transformers, every test module), and each full
    pass of the cyclic collector walks all of it, a quarter of a second; at the default pace (one
    full pass per ten middle ones) those passes were a few per cent of the suite's time. Full
    passes come ten times less often; the young generations are collected as before."""
    saved = gc.get_threshold()
    gc.set_threshold(saved[0], saved[1], saved[2] * 10)
    yield
    gc.set_threshold(*saved)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_in_test_processes():
    """torch in a test process itself (transformers' reference outputs, a stage run in process) uses
    one thread: ``make test``'s three test processes share two cores, and an operator split over two
    OpenMP threads spins until both are scheduled (a tiny model's greedy tokens took over ten times
    the CPU of one thread). Set where the collected tests imported torch, never imported for it; a
    test of threaded code sets its own count. What a test starts (workers, ``hetserve`` commands)
    chooses its threads as before."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session", autouse=True)
def _fork_workers_from_a_server():
    """Engines in tests (and the ``hetserve serve`` processes they start, which inherit the
    environment) start their workers from a fork server that imported torch once, not a fresh
    interpreter each: most of an engine test's CPU was its workers importing torch. The default
    (spawn) keeps its own tests (``tests/runtime/test_start_methods.py``)."""
    from hetserve.runtime.engine_config import START_METHOD_ENV

    saved = os.environ.get(START_METHOD_ENV)
    os.environ[START_METHOD_ENV] = "forkserver"
    yield
    if saved is None:
        os.environ.pop(START_METHOD_ENV, None)
    else:
        os.environ[START_METHOD_ENV] = saved


@pytest.fixture(scope="session", autouse=True)
def _one_default_tls_context_for_http_clients():
    """Every httpx client (each ``httpx.get`` / ``post`` / ``stream``, each OpenAI client) loads a CA
    bundle into a new TLS context: 45 ms of CPU or more, most of it in the loops that poll a starting
    server, taking the core the server starts on. The tests speak plain HTTP to 127.0.0.1: a context
    for the default arguments (verify=True, no client certificate) is built once per CA setting
    (SSL_CERT_FILE / SSL_CERT_DIR as httpx reads them) and shared, as an SSLContext may be; other
    arguments build their own as before."""
    try:  # a private name of the pinned httpx: another version's clients build their own, as before
        from httpx._transports import default as transport

        make = transport.create_ssl_context
    except (ImportError, AttributeError):
        yield
        return
    shared = {}

    def once(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = make(trust_env=trust_env)
        return shared[key]

    transport.create_ssl_context = once
    yield
    transport.create_ssl_context = make


@pytest.fixture(scope="session", autouse=True)
def _read_each_bundled_trace_once():
    """The bundled traces (azure-conv, sharegpt) are read, row by row and checked, by most planner and
    CLI tests: a third of a second each time. Each is read once per process for each rate and seed
    asked; every call gets its own copy of the arrays, so a test that changes one changes nothing
    for the next. Files outside the package (the traces tests write) are read every time."""
    import numpy as np

    from hetserve.specs import workload

    read = workload._read_csv
    bundled = Path(str(workload.resources.files("hetserve") / "data" / "workloads")).resolve()
    kept = {}

    def once(path, rate, seed, name):
        if Path(path).resolve().parent != bundled:
            return read(path, rate, seed, name)
        key = (str(path), rate, seed, name)
        if key not in kept:
            kept[key] = read(path, rate, seed, name)
        wl = kept[key]
        return dataclasses.replace(wl, **{f.name: getattr(wl, f.name).copy() for f in dataclasses.fields(wl)
                                          if isinstance(getattr(wl, f.name), np.ndarray)})

    workload._read_csv = once
    yield
    workload._read_csv = read


@pytest.fixture(scope="session", autouse=True)
def _keep_every_group_bound():
    """Many tests plan the same presets (het1, het2, het3 with llama-2-70b on azure-conv) and so price
    the same group bound, a MILP of up to a minute. ``bound``'s cache keeps 64 of them, first in first
    out, and the budgeted bounds of min_cost's bisections in between pushed the presets' bounds out,
    so each was solved three times in a run. Keep every bound for the session: a cached one is what
    the same code computed for the same inputs (the key is everything the bound reads)."""
    from hetserve.planner.bound import throughput as bound

    saved = bound._CACHE_SIZE
    bound._CACHE_SIZE = 100_000
    yield
    bound._CACHE_SIZE = saved


@pytest.fixture(scope="session", autouse=True)
def _share_group_bounds_between_workers(tmp_path_factory):
    """With two pytest workers (``make test``: pytest-xdist) each process solved het1's and het2's
    group bounds itself, about a minute each. Solved once, each bound is kept on disk under the
    session's temporary root, keyed by everything it reads (``bound._fingerprint``), and the other
    worker reads it; a lock per bound makes a worker that needs one being solved wait for it rather
    than solve it again."""
    from hetserve.planner.bound import throughput as bound

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders share this one
    folder = root / "group-bounds"
    folder.mkdir(exist_ok=True)
    solve = bound._group_bound

    def shared(ctx, budget_usd_per_hour, devices, node_limit, time_limit_s):
        # solved to the end whatever time the search left it: a bound cut at a load-dependent
        # moment would make the tests that read it depend on the load (the tests of the time
        # limit itself call ``__wrapped__``)
        key = hashlib.sha256(pickle.dumps(bound._fingerprint(ctx, budget_usd_per_hour, devices, node_limit)))
        path = folder / f"{key.hexdigest()}.pkl"
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return pickle.loads(path.read_bytes())
            result = solve(ctx, budget_usd_per_hour, devices, node_limit, None)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(result))
            tmp.replace(path)
            return result

    shared.__wrapped__ = solve  # a test that spies on a fresh solve calls this one
    bound._group_bound = shared
    yield
    bound._group_bound = solve
