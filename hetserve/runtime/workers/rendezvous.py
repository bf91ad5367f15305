"""Where the runtime listens: one bind address per process, checked, and TP groups that use it.

Every socket the runtime opens binds one named address — the engine's endpoint and rendezvous
store bind the engine's ``host``, each worker's endpoint and its gloo device bind its node's
address — and advertises that same address to its peers. None binds all interfaces: a pool that
spans machines is reachable where it says it is, and nowhere else.

Ports: ``listen_socket`` is where the runtime's own listeners (the engine's endpoint, its TP
rendezvous store, each worker's endpoint) get theirs: the OS picks one, or, with a ``PortRange``
(``--port-range LO-HI``, ``EngineConfig.port_range``), the first free one in the range, for
firewalls that open fixed ports. gloo's and NCCL's own sockets take ports the range does not cover.

Two things in torch would otherwise bind more than asked for:

- ``TCPStore(host, 0, is_master=True)`` listens on every interface whatever ``host`` says; the
  store here is handed a socket already bound to ``host`` (``master_listen_fd``).
- gloo picks its own address from the machine's hostname (or ``GLOO_SOCKET_IFNAME``), which on many
  hosts resolves to 127.0.x.1 — unreachable from other machines, and not the node's address when
  several nodes share one machine. The TP group here uses gloo with a device bound to ``host``
  (registered as the backend ``hetserve_gloo``). NCCL's own bootstrap picks its interface from
  ``NCCL_SOCKET_IFNAME``; only its rendezvous goes through the store.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

from hetserve.errors import RuntimeFailure

LOOPBACK = "127.0.0.1"
_WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}
GLOO = "hetserve_gloo"  # gloo with a device bound to the worker's address


def check_bind_address(host: str, what: str = "address") -> str:
    """``host`` if it names one address; ValueError for a wildcard (all interfaces) or a malformed one.

    A wildcard is any spelling the resolver reads as the unspecified address ("0", "0x0", "::0",
    "00.0.0.0" as well as "0.0.0.0" and "::"): numeric forms are parsed without a DNS query, so a
    host name is taken as written. Brackets around an IPv6 literal ("[::1]") are refused: a socket
    binds the bare address."""
    text = "" if host is None else str(host).strip()
    if text in _WILDCARDS or _unspecified(text):
        raise ValueError(f"{what} must name this machine's address on the network its peers use "
                         f"(e.g. 10.0.0.5), not {host!r}: that listens on every interface and advertises none")
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not all(part and len(part) < 64 for part in text.split(".")) or any(c in text for c in " []"):
            raise ValueError(f"{what} {text!r} is neither an IP address nor a host name") from None
    return text


def _unspecified(text: str) -> bool:
    """Whether a numeric spelling of ``text`` is 0.0.0.0 or :: (no name lookup)."""
    try:
        infos = socket.getaddrinfo(text, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        return False  # not numeric: a host name
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_unspecified for info in infos)


@dataclass(frozen=True)
class PortRange:
    """The ports ``lo``..``hi`` (both included) the runtime's own listeners take theirs from."""

    lo: int
    hi: int

    EXPECTED = "LO-HI with 1 <= LO <= HI <= 65535 (e.g. 20000-20099)"

    def __post_init__(self) -> None:
        # the one check of the bounds: parse and of build through here
        if not (type(self.lo) is int and type(self.hi) is int and 1 <= self.lo <= self.hi <= 65535):
            raise _expected(f"{self.lo}-{self.hi}")

    @classmethod
    def parse(cls, text: str) -> "PortRange":
        """``"LO-HI"``; ValueError saying what was expected otherwise."""
        m = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", str(text))
        if m is None:
            raise _expected(text)
        return cls(int(m[1]), int(m[2]))

    @classmethod
    def of(cls, value) -> "PortRange | None":
        """None, a ``PortRange``, ``"LO-HI"`` or ``(lo, hi)`` as a ``PortRange`` (None stays None);
        ValueError saying what was expected otherwise."""
        if value is None or isinstance(value, PortRange):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise _expected(value, " or a pair (LO, HI)")
        return cls(*value)

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


def _expected(got, also: str = "") -> ValueError:
    """The one line every malformed port range gets."""
    return ValueError(f"expected {PortRange.EXPECTED}{also}, got {got!r:.60}")


def listen_socket(host: str, ports: PortRange | None = None, what: str = "a listener") -> socket.socket:
    """A TCP listening socket bound to ``host`` (IPv4, IPv6 or a host name): on a port the OS picks,
    or on the first free port of ``ports``. ``RuntimeFailure`` in one line otherwise: naming the
    range when none of its ports is free (or one needs privileges), naming the host when the
    address itself cannot be bound (not this machine's, a name that does not resolve)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in (0,) if ports is None else range(ports.lo, ports.hi + 1):
        try:
            return socket.create_server((host, port), family=family)
        except OSError as exc:
            if ports is not None and exc.errno == errno.EADDRINUSE:
                continue
            if ports is not None and exc.errno == errno.EACCES:  # a port below 1024 without the privilege
                raise RuntimeFailure(f"--port-range {ports}: {what} cannot listen on {host}:{port} "
                                     f"({exc.strerror or exc}); choose ports this user may open") from exc
            not_here = "; it must be an address of this machine" if exc.errno == errno.EADDRNOTAVAIL else ""
            raise RuntimeFailure(f"{what} cannot listen on {host} ({exc.strerror or exc}){not_here}") from exc
    raise RuntimeFailure(f"--port-range {ports}: no free port left on {host} for {what}, every one of its "
                         f"{ports.hi - ports.lo + 1} is taken; widen the range (on each machine this deployment "
                         "listens on one port per worker there, and the engine's on one or two: its endpoint "
                         "and, with TP groups, their rendezvous store)")


def needs_store(tp_worlds, device_channels: bool) -> bool:
    """Whether the engine runs the rendezvous store: TP groups (a world above 1) and device channels
    meet through it, so it listens where any of them exists and nowhere else."""
    return bool(device_channels) or any(t > 1 for t in tp_worlds)


class BoundStore:
    """The rendezvous store of TP groups (a ``torch.distributed.TCPStore`` master) listening on ``host`` only."""

    def __init__(self, host: str, ports: PortRange | None = None):
        import torch.distributed as dist

        sock = listen_socket(host, ports, "the TP rendezvous store")
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.store = dist.TCPStore(self.address[0], self.address[1], is_master=True, wait_for_workers=False,
                                   master_listen_fd=sock.fileno(), use_libuv=True)
        sock.detach()  # the store serves on this very socket and closes it when it goes

    def close(self) -> None:
        self.store = None


def init_tp_group(backend: str, store_address: tuple[str, int], prefix: str, rank: int, world: int,
                  host: str, timeout_s: float) -> None:
    """Join this process's TP group (the default process group) through the store at ``store_address``.

    ``backend`` "gloo" binds gloo's device to ``host``; "nccl" is NCCL as configured by its
    environment for CUDA tensors, beside that bound gloo for host tensors (the leader's message
    headers, broadcast as host bytes: NCCL alone moves only CUDA tensors). ``prefix`` keeps the
    keys of different groups apart in one store.
    """
    import torch.distributed as dist

    store = dist.TCPStore(store_address[0], store_address[1], is_master=False, timeout=timedelta(seconds=60))
    group_store = dist.PrefixStore(prefix, store)
    dist.init_process_group(tp_backend(backend, host), store=group_store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def tp_backend(backend: str, host: str) -> str:
    """What ``init_process_group`` is given for a TP group of ``backend``: each device type's backend."""
    _register_bound_gloo(host)
    return GLOO if backend == "gloo" else f"cpu:{GLOO},cuda:{backend}"


def _register_bound_gloo(host: str) -> None:
    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    def create(store, rank, size, timeout):
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(store, rank, size, opts)

    if not hasattr(dist.Backend, GLOO.upper()):  # one registration per process
        dist.Backend.register_backend(GLOO, create, devices=["cpu", "cuda"])
