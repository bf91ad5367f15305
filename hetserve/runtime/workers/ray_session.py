"""A Ray connection for serving (``RaySession``): join a pool, or start a private one-node Ray on
loopback; the per-machine custom resources workers are placed by; token authentication by default.

``ray_backend`` runs the engine's workers on the session this opens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import threading

from hetserve.runtime.workers import ray_leftovers
from hetserve.runtime.workers.rendezvous import LOOPBACK

RESOURCE_PREFIX = "hetserve_machine_"


def machine_resource(machine: str) -> str:
    return RESOURCE_PREFIX + machine


def ray_auth_env(environ: dict[str, str], joining: bool) -> dict[str, str]:
    """What to add to ``environ`` before Ray starts or is joined, so that it runs with token
    authentication unless ``RAY_AUTH_MODE`` says otherwise.

    Ray (>= 2.59) turns token authentication on by itself where the mode is unset and a token is at
    hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``). A private Ray without
    one gets a fresh token here (kept in this process's environment, no file written); a driver
    joining a pool without the pool's token is refused, with where to put it. Explicitly disabled
    authentication is honoured, with a warning.
    """
    mode = environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        logging.getLogger("hetserve.runtime").warning(
            "Ray token authentication is off (RAY_AUTH_MODE=%s): whoever reaches Ray's ports can run code "
            "on every node", mode)
        return {}
    if (environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH")
            or os.path.exists(os.path.expanduser("~/.ray/auth_token"))):
        return {}
    if joining:
        raise ValueError("Ray token authentication is on, and this machine has no token for the pool: set "
                         "RAY_AUTH_TOKEN_PATH to the token file its nodes were started with "
                         "(docs/multinode.md), or RAY_AUTH_MODE=disabled on a network no one else reaches")
    return {"RAY_AUTH_TOKEN": secrets.token_hex(32)}


RAY_CLIENT_PORT = 10001  # Ray client's port, where a ray:// address names none (Ray's own default)
ANSWER_TIMEOUT_S = 5.0  # a pool's head answers a TCP connect well within this, even across sites


def check_ray_address(address: str, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """``RuntimeFailure`` in one line when nothing answers a TCP connect at ``--ray-address``, before
    ``ray.init`` is asked to join it: Ray retries an absent head for minutes, printing only its own
    GCS messages. ``HOST:PORT`` and ``ray://HOST[:PORT]``
    are checked; what names no address to connect to (``auto``, which Ray resolves from the files
    of a Ray started on this machine, ``local``, a host without a port) is left to Ray."""
    import socket
    from urllib.parse import urlsplit

    from hetserve.errors import RuntimeFailure

    text = address.strip()
    client = text.startswith("ray://")
    rest = text[len("ray://"):] if client else text
    if "://" in rest or text in ("auto", "local"):
        return
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is no number: Ray's own error says so
        return
    port = port if port is not None else (RAY_CLIENT_PORT if client else None)
    if not host or port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        why = "no answer within %g s" % timeout_s if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise RuntimeFailure(f"--ray-address {address}: nothing answers at {host}:{port} ({why}): start the Ray "
                             "head there (docs/multinode.md) or drop --ray-address for a private Ray") from exc


class RaySession:
    """A Ray connection for serving: joins ``address`` or starts a private local Ray.

    The private Ray is one node on 127.0.0.1: its own servers (GCS, raylet, its worker processes'
    gRPC servers, the monitor's metrics port, the runtime-env agent) listen on loopback only, and
    hetserve's listeners with it bind that address (``node_ip``). It keeps its files under
    ``tmp_dir`` (default ``$RAY_TMPDIR``, else a fresh temporary folder that ``close()`` removes)
    and advertises one custom resource per machine. ``close()`` shuts down what this session started.
    A folder of its own carries an owner marker: the next private start, or a close, removes those
    whose owner died without closing (``ray_leftovers``). A stop signal while ``ray.init`` runs ends
    the start within seconds (``_stops_on_signal``).
    """

    # (GCS address, node IP) of the private Ray this process started: hetserve binds that IP while
    # that very Ray is the one connected (one shut down by ray.shutdown() alone leaves no trace)
    _private: tuple[str, str] | None = None

    def __init__(self, started: bool, tmp_dir: str | None, private: bool = False, made_tmp_dir: bool = False):
        self.started, self.tmp_dir = started, tmp_dir
        self.private = private  # a one-node Ray of this session: every machine on loopback
        self.made_tmp_dir = made_tmp_dir  # tmp_dir is this session's own, removed by close()

    @staticmethod
    def start(cluster, address: str | None = None, num_cpus: int = 2, tmp_dir: str | None = None,
              node_ip_address: str | None = None) -> "RaySession":
        """``node_ip_address``: this (driver's) machine's address on the pool's network, when Ray's own
        guess (the address that reaches the head) is not the one to use."""
        import ray

        if ray.is_initialized():
            return RaySession(False, None)
        if address:
            check_ray_address(address)
        os.environ.update(ray_auth_env(dict(os.environ), joining=bool(address)))
        if address:
            extra = {"_node_ip_address": node_ip_address} if node_ip_address else {}
            with _stops_on_signal(None):  # joining starts no Ray process here
                ray.init(address=address, include_dashboard=False, log_to_driver=False, **extra)
            return RaySession(True, None)
        made = False
        tmp_dir = tmp_dir or os.environ.get("RAY_TMPDIR")
        if tmp_dir is None:
            import tempfile

            tmp_dir = tempfile.mkdtemp(prefix=ray_leftovers.FOLDER_PREFIX, dir=TMP_PARENT)
            made = True
            ray_leftovers.write_owner(tmp_dir)
            ray_leftovers.sweep(TMP_PARENT)  # what a session killed before its close() left
        resources = {machine_resource(m): 1000.0 for m in cluster.machines}
        session = RaySession(False, tmp_dir, private=True, made_tmp_dir=made)
        with _stops_on_signal(session):
            try:
                with _ray_keeps_loopback():
                    ray.init(num_cpus=num_cpus, resources=resources, include_dashboard=False, _temp_dir=tmp_dir,
                             log_to_driver=False, _node_ip_address=LOOPBACK)
            except BaseException:
                # a start that failed half-way may have left Ray's servers running: end them before their folder goes
                ray.shutdown()
                session.close()
                raise
        session.started, RaySession._private = True, (ray.get_runtime_context().gcs_address, LOOPBACK)
        where = sorted({str(n.get("NodeManagerAddress")) for n in ray.nodes()})
        if where != [LOOPBACK]:
            logging.getLogger("hetserve.runtime").warning("the private Ray runs on %s, not %s: its own servers "
                                                          "listen beyond loopback", ", ".join(where), LOOPBACK)
        return session

    @staticmethod
    def node_ip() -> str:
        """The address this (driver's) node is reached at: 127.0.0.1 with a private Ray (the address it
        was started on), else the IP Ray knows the node by."""
        import ray

        return RaySession.private_ip() or ray.util.get_node_ip_address()

    @staticmethod
    def private_ip() -> str | None:
        """The node IP of the private Ray this process started, while it is the Ray connected; else None."""
        import ray

        private = RaySession._private
        if private is None or not ray.is_initialized() or ray.get_runtime_context().gcs_address != private[0]:
            return None
        return private[1]

    def close(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
            if self.private:
                RaySession._private = None
        if self.made_tmp_dir and self.tmp_dir is not None:
            # Ray's session logs and sockets, in a folder it made world-writable: nothing of it outlives the session
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.made_tmp_dir = False
            ray_leftovers.sweep(os.path.dirname(self.tmp_dir))


TMP_PARENT = "/tmp"  # where a private Ray's own folder goes: Ray's socket paths must stay under 107 bytes


@contextlib.contextmanager
def _ray_keeps_loopback():
    """While a private Ray starts: Ray keeps a node on 127.0.0.1 (its servers on loopback) only with its
    cluster mode off, else it swaps a loopback ``_node_ip_address`` for the machine's outward address
    and listens on every interface. ``ray`` reads the mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) when
    first imported, so the flag it set is held off too; both are restored after (a later join is as before)."""
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_CLUSTER_MODE_ENV), getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_CLUSTER_MODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(_CLUSTER_MODE_ENV, None)
        else:
            os.environ[_CLUSTER_MODE_ENV] = saved_env
        if saved_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag


_CLUSTER_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
HARD_STOP_AFTER_S = 2.0  # a stop signal's grace for ray.init to unwind before the process is ended
STOPPED_EXIT = 130  # as `hetserve serve` stopped while starting


@contextlib.contextmanager
def _stops_on_signal(session: "RaySession | None"):
    """SIGTERM or SIGINT while ``ray.init`` runs ends the start within seconds, in the main thread.

    Python runs a signal's handler only when the main thread is between bytecodes, and ray.init
    waits in C++ (GcsClient's connect: up to ~30 s a try, retried for minutes), so no handler runs
    until that returns; ray.init also puts in its own SIGTERM handler (``sys.exit(15)``). So
    CPython's C-level handler writes each signal to a wakeup pipe, read by a thread here (the C++
    wait releases the GIL). The signal's own exception (Ray's SystemExit made the KeyboardInterrupt
    a stop signal is in serving) gets ``HARD_STOP_AFTER_S`` to unwind the block; where it is still
    running then, the thread stops the Ray processes this process started for ``session`` (those
    naming or writing into its folder), removes the folder if the session made it, says so in one
    line on stderr and ends the process with ``STOPPED_EXIT``. The handlers are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(read_end, done, session), name="ray-start-signals", daemon=True)
    watcher.start()
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise KeyboardInterrupt from exc  # Ray's handler's
    finally:
        done.set()
        signal.set_wakeup_fd(old_fd)
        os.write(write_end, b"\0")  # no signal: the watcher leaves
        watcher.join()
        os.close(read_end)
        os.close(write_end)
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)


def _watch(read_end: int, done: threading.Event, session: "RaySession | None") -> None:
    while not done.is_set():
        signum = os.read(read_end, 1)[0]
        if signum in STOP_SIGNALS and not done.wait(HARD_STOP_AFTER_S):
            _hard_stop(signal.Signals(signum).name, session)


def _hard_stop(name: str, session: "RaySession | None") -> None:
    import psutil  # on the path: ray is imported

    said = "it had started no Ray process"
    if session is not None and session.tmp_dir is not None:
        stopped = 0
        for _ in range(2):  # ray.init may have started one more meanwhile
            stopped += ray_leftovers.stop_processes(
                ray_leftovers.ray_processes(session.tmp_dir, among=psutil.Process().children(recursive=True)))
        if session.made_tmp_dir:
            shutil.rmtree(session.tmp_dir, ignore_errors=True)
        said = f"the {stopped} Ray process(es) it had started have exited"
    os.write(2, f"hetserve: stopped by {name} while Ray was starting (ray.init had not returned {HARD_STOP_AFTER_S:g} s "
                f"later); {said}\n".encode())
    os._exit(STOPPED_EXIT)
