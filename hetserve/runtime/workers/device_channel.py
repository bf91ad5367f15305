"""Tensors between two workers without the host round trip: the bytes go device to device, only a
small header goes on the authenticated socket.

    sender: send(peer, msg)                                  receiver: its transport's receive hook
      header {seq, tensors[, ipc]} ── socket, CONTROL ──►   check it against what this kind of message
      tensor bytes ─────────── the pair's group ──────►     must carry, allocate, receive (timeout)
      holds the tensors until ◄── channel_ack {seq, ok} ──  acknowledge; deliver the message, tensors in

How the bytes go (``ChannelPeer.kind``, chosen per pair in ``channel_pairs.py``;
``channel_backends.py``): ``gloo`` (CPU workers: the same code path in CI), ``nccl`` (workers on
distinct GPUs: point-to-point on a two-rank communicator) or ``ipc`` (two workers of one GPU: the
receiver opens the sender's allocation by CUDA IPC and copies it on the device). Each pair has its
own group, made from the deployment's rendezvous store, so a lost worker breaks only the
groups it was in (a gloo or NCCL group cannot survive a lost member).

Rules, and why:

- Headers and acknowledgements ride the CONTROL class, FIFO per link, so headers arrive in the order
  the bytes were sent; NCCL matches point-to-point operations in issue order, not by tag. A header
  out of turn breaks the channel rather than risk a mismatched receive.
- The receiver allocates only what its expectation for the message's kind says (``expect``: names,
  dtypes, shapes from the message's own metadata and the worker's layout), within the deployment's
  message bound; an unexpected header is refused, never allocated.
- No transfer hangs and none is lost. Every wait has a deadline (``timeout_s``). A failed, refused or
  timed-out transfer breaks the pair's channel; its sender resends every unacknowledged message over
  the socket (marked ``dc_resend``) and sends later ones there too; the receiver delivers each
  sequence number at most once. Where the peer itself is gone, the socket send fails as before and
  the engine's recovery re-runs the requests the dead worker held.
- Emulated links (a link scheduler or shaper: ``--shape-links``) and pairs without a common group
  use the socket; ``stats()`` counts which path each transfer took.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from hetserve.runtime.workers.auth import DEFAULT_MAX_MESSAGE_BYTES
from hetserve.runtime.workers.channel_backends import (
    ChannelError,
    IpcOpenFailed,
    isend,
    open_ipc,
    pair_group,
    release_ipc,
    share_cuda,
    tag,
    wait,
    wire_device,
)
from hetserve.runtime.workers.channel_pairs import ChannelPeer
from hetserve.runtime.workers.transport import Priority, Transport
from hetserve.runtime.workers.wire import (
    DTYPES,
    MalformedMessage,
    Message,
    check_tensor_spec,
)

log = logging.getLogger("hetserve.runtime.workers.device_channel")
ACK = "channel_ack"
Expectation = Callable[[dict], dict[str, tuple[torch.dtype, tuple[int, ...]]]]


@dataclass
class _Pending:
    msg: Message  # as the caller sent it, tensors included, for a resend
    priority: Priority
    deadline: float
    works: list = field(default_factory=list)  # keep the sends (and their tensors) alive


@dataclass
class _Link:
    spec: ChannelPeer
    group: object = None  # the pair's ProcessGroup (gloo, nccl); None for ipc
    broken: str = ""  # why the channel stopped; "" while it works
    next_out: int = 0  # next sequence number sent
    next_in: int = 0  # next sequence number expected
    pending: dict[int, _Pending] = field(default_factory=dict)
    awaiting: set[int] = field(default_factory=set)  # refused or failed here: delivered when resent
    # seq -> (until, works) of transfers resent by socket whose channel sends stay alive (``_break``)
    given_up: dict[int, tuple[float, list]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the fields above
    # held by a send and by a break: re-entrant, since a send whose channel fails breaks it
    order: threading.RLock = field(default_factory=threading.RLock)
    ready: threading.Event = field(default_factory=threading.Event)  # set once the group is joined


class DeviceChannel:
    """The device channels of one worker, beside its socket transport (see the module docstring)."""

    def __init__(self, transport: Transport, peers: tuple[ChannelPeer, ...], device: torch.device | str,
                 timeout_s: float = 30.0, max_bytes: int | None = None, min_bytes: int = 0):
        self.transport = transport
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        security = getattr(transport, "security", None)
        self.max_bytes = max_bytes or getattr(security, "max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
        self.min_bytes = min_bytes  # smaller messages go on the socket: one message instead of two
        self.links = {p.peer: _Link(p) for p in peers}
        for link in self.links.values():
            if link.spec.kind == "ipc":
                link.ready.set()
        self.expect: dict[str, Expectation] = {}  # message kind -> what its tensors must be
        self.counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()
        self._closed = False
        transport.receive_hook = self._on_receive

    # ------------------------------------------------------------------ set-up
    def connect(self, store_address: tuple[str, int] | None, host: str) -> None:
        """Join every pair's group, in one global order (pairs sorted by name) so that no two workers
        wait on each other's second group; then start the deadline watch."""
        import torch.distributed as dist

        store = None
        for link in sorted(self.links.values(), key=lambda l: l.spec.group):
            if link.spec.kind == "ipc":
                continue
            if store is None:
                store = dist.TCPStore(store_address[0], store_address[1], is_master=False,
                                      timeout=timedelta(seconds=max(self.timeout_s, 60.0)))
            link.group = pair_group(link.spec.kind, link.spec.rank, dist.PrefixStore(link.spec.group, store),
                                    host, self.device, self.timeout_s)
            link.ready.set()
        threading.Thread(target=self._watch, name=f"{self.transport.name}-channel", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for link in self.links.values():
            link.group = None

    def stats(self) -> dict[str, int]:
        """Transfers and bytes sent by path (``channel_*``, ``socket_*``) and received by the channel
        (``channel_in_*``); transfers ``resent`` by socket, headers ``refused``, channels ``failed``;
        resends received: ``resends_taken`` (delivered), ``resends_dropped`` (the channel had delivered
        them). Each transfer is delivered once: between live peers whose channel sends all started,
        the receivers' channel_in + resends_taken equal the senders' channel_transfers."""
        with self._counts_lock:
            return dict(self.counts)

    # ------------------------------------------------------------------ sending
    def on_device(self, peer: str, nbytes: int) -> bool:
        """Whether ``nbytes`` of tensors sent to ``peer`` now stay on the device (a working NCCL or IPC
        channel, a message big enough for it), so the host never reads them back; False where they
        go by socket or gloo, through the host (``send`` decides the same way)."""
        link = self.links.get(peer)
        return self._fits(link, nbytes) and not link.broken and link.spec.kind != "gloo"

    def _fits(self, link: _Link | None, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` of tensors is one for the channel ``link`` (there is one,
        and the message is big enough to gain by it)."""
        return link is not None and nbytes >= self.min_bytes

    def send(self, peer: str, msg: Message, priority: Priority = Priority.CONTROL) -> str:
        """Send ``msg``: its tensors by the pair's channel where there is one that works, else by the
        socket. Returns the path taken."""
        link = self.links.get(peer)
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
        if not msg.tensors or not self._fits(link, nbytes):
            return self._by_socket(peer, msg, priority, nbytes)
        with link.order:  # after a break, this waits until the resends are queued: none is overtaken
            if link.broken:
                return self._by_socket(peer, msg, priority, nbytes)
            return self._by_channel(link, msg, priority, nbytes)

    def _by_socket(self, peer: str, msg: Message, priority: Priority, nbytes: int) -> str:
        self._count("socket", nbytes)
        self.transport.send(peer, msg, priority)
        return "socket"

    def _by_channel(self, link: _Link, msg: Message, priority: Priority, nbytes: int) -> str:
        peer = link.spec.peer
        # a snapshot, as the socket's encode takes one: the caller may reuse its buffers (a step runner's
        # static output, replayed by the next step) while the peer has yet to read them
        tensors = {n: t.detach().clone(memory_format=torch.contiguous_format) for n, t in msg.tensors.items()}
        specs = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
                 for n, t in tensors.items()]
        with link.lock:
            seq = link.next_out
            link.next_out += 1
            header = {"seq": seq, "tensors": specs}
            meta = {k: v for k, v in msg.meta.items() if k not in ("dc", "dc_resend")}
            pending = _Pending(Message(msg.kind, meta, tensors), priority, time.monotonic() + self.timeout_s)
            link.pending[seq] = pending
            try:
                if link.spec.kind == "ipc":
                    header["ipc"] = [share_cuda(t) for t in tensors.values()]
                self.transport.send(peer, Message(msg.kind, {**meta, "dc": header}), Priority.CONTROL)
                if link.spec.kind == "ipc":
                    pending.works = list(tensors.values())
                else:
                    pending.works = [isend(link.group, link.spec.kind, link.spec.rank, t, seq)
                                     for t in tensors.values()]
                failed = None
            except RuntimeError as exc:  # the pair's group is gone (its peer died), or IPC refused
                failed = exc
        if failed is not None:
            with link.lock:
                link.pending.pop(seq, None)
            self._break(link, f"send failed: {failed}", resend=[(seq, pending)])
            return "socket"
        self._count("channel", nbytes)
        return "channel"

    def _on_ack(self, src: str, meta: dict) -> None:
        link = self.links.get(src)
        if link is None:
            return
        with link.lock:
            pending = link.pending.pop(meta.get("seq"), None)
            link.given_up.pop(meta.get("seq"), None)  # the receiver is done with it, either way
        if pending is not None and not meta.get("ok"):
            self._break(link, f"the receiver could not take transfer {meta.get('seq')}: {meta.get('error')}",
                        resend=[(meta.get("seq"), pending)], acked=True)

    def _watch(self) -> None:
        """Resend over the socket what a peer did not acknowledge in time."""
        while not self._closed:
            time.sleep(0.05)
            now = time.monotonic()
            for link in self.links.values():
                with link.lock:
                    late = sorted(s for s, p in link.pending.items() if p.deadline < now)
                    overdue = [(s, link.pending.pop(s)) for s in late]
                    for s in [s for s, (until, _) in link.given_up.items() if until < now]:
                        del link.given_up[s]
                if overdue:
                    self._break(link, f"no acknowledgement within {self.timeout_s:.1f} s", resend=overdue)

    def _break(self, link: _Link, why: str, resend: list[tuple[int, _Pending]], acked: bool = False) -> None:
        """Stop using the pair's channel; send what it did not deliver, and everything after, by socket.
        The resends are queued under the link's order lock, so no later send can go ahead of them.

        A transfer not yet acknowledged (all but an ``acked`` refusal) keeps its channel send alive
        until its acknowledgement comes, or twice the timeout: gloo drops a send whose work is freed,
        so a receiver that takes the header late (a slow or frozen process) would wait out its
        timeout for bytes never sent, and would read CUDA IPC memory after its reuse. Kept, the bytes
        arrive and the receiver drops the resend as delivered."""
        with link.order:
            with link.lock:
                first = not link.broken
                link.broken = link.broken or why
                rest = sorted(link.pending.items())
                link.pending.clear()
                until = time.monotonic() + 2 * self.timeout_s
                link.given_up.update((s, (until, p.works)) for s, p in (rest if acked else resend + rest) if p.works)
            if first:
                self._bump("failed")
            for seq, p in sorted(resend + rest, key=lambda item: item[0]):
                self._bump("resent")
                try:
                    self.transport.send(link.spec.peer, Message(p.msg.kind, {**p.msg.meta, "dc_resend": seq},
                                                                p.msg.tensors), Priority.CONTROL)
                except ConnectionError:
                    break  # this endpoint is closing; the engine re-runs what was in flight
        if first:
            log.warning("%s: channel to %s broken (%s); the socket carries its transfers", self.transport.name,
                        link.spec.peer, why)

    # ------------------------------------------------------------------ receiving
    def _on_receive(self, msg: Message) -> list[Message]:
        if msg.kind == ACK:
            self._on_ack(msg.src, msg.meta)
            return []
        if "dc_resend" in msg.meta:
            return self._on_resend(msg)
        header = msg.meta.pop("dc", None)
        if header is None:
            return [msg]
        link = self.links.get(msg.src)
        if link is None:
            log.warning("%s: a channel header from %s, which shares no channel with it", self.transport.name,
                        msg.src)
            return []
        seq = header.get("seq") if isinstance(header, dict) else None
        try:
            with link.lock:
                if link.broken:
                    raise ChannelError(f"channel broken: {link.broken}")
                if seq != link.next_in:
                    raise ChannelError(f"transfer {seq!r} out of turn (expected {link.next_in})")
                link.next_in += 1
            msg.tensors = self._receive(link, header, self._expected(msg))
        except Exception as exc:  # noqa: BLE001 - a receive that fails must not end the reading thread
            # RuntimeError: what torch.distributed raises for a lost peer or a timeout
            if link.spec.kind == "ipc" and not isinstance(exc, IpcOpenFailed) and isinstance(header, dict):
                release_ipc(header.get("ipc"), self.device)  # refused before any was opened
            self._bump("refused" if isinstance(exc, (MalformedMessage, ValueError)) else "failed")
            with link.lock:
                first = not link.broken
                link.broken = link.broken or str(exc)
                if isinstance(seq, int):
                    link.awaiting.add(seq)
            if first:
                log.warning("%s: transfer %s from %s not taken (%s); its sender resends it by socket",
                            self.transport.name, seq, msg.src, exc)
            self._ack(msg.src, seq, False, str(exc))
            return []
        self._ack(msg.src, seq, True)
        return [msg]

    def _on_resend(self, msg: Message) -> list[Message]:
        """A transfer the sender gave up on the channel: delivered unless the channel already did."""
        seq = msg.meta.pop("dc_resend")
        link = self.links.get(msg.src)
        if link is None:
            return [msg]
        with link.lock:
            if seq in link.awaiting:
                link.awaiting.discard(seq)
            elif isinstance(seq, int) and seq >= link.next_in:
                link.next_in = seq + 1  # its header never came: nothing on the channel to wait for
            else:
                seq = None  # delivered by the channel already
        self._bump("resends_taken" if seq is not None else "resends_dropped")
        return [msg] if seq is not None else []

    def _expected(self, msg: Message) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        rule = self.expect.get(msg.kind)
        if rule is None:
            raise MalformedMessage(f"no tensors expected on a {msg.kind!r} message")
        return rule(msg.meta)

    def _receive(self, link: _Link, header: dict, expected: dict) -> dict[str, torch.Tensor]:
        specs = header.get("tensors")
        if not isinstance(specs, list):
            raise MalformedMessage("a channel header without a tensor list")
        for spec in specs:
            check_tensor_spec(spec)
        got = {s[0]: (DTYPES[s[1]], tuple(s[2])) for s in specs}
        want = {n: (dt, tuple(shape)) for n, (dt, shape) in expected.items()}
        if got != want:
            raise MalformedMessage(f"tensors {_say(got)} where {_say(want)} were expected")
        total = sum(s[3] for s in specs)
        if total > self.max_bytes:
            raise MalformedMessage(f"{total} bytes (this deployment's bound: {self.max_bytes})")
        if not link.ready.wait(self.timeout_s):  # the peer sent before this end finished joining the group
            raise ChannelError(f"the channel's group was not joined within {self.timeout_s:.1f} s")
        if link.spec.kind == "ipc":
            out = open_ipc(header.get("ipc"), specs, self.device)
        else:
            out = {}
            for name, (dtype, shape) in got.items():
                buf = torch.empty(shape, dtype=dtype, device=wire_device(link.spec.kind, self.device))
                wait(link.group.recv([buf], 1 - link.spec.rank, tag(header["seq"])), self.timeout_s)
                out[name] = buf
        self._count("channel_in", total)
        return out

    def _ack(self, peer: str, seq, ok: bool, error: str = "") -> None:
        try:
            self.transport.send(peer, Message(ACK, {"seq": seq, "ok": ok, "error": error[:500]}), Priority.CONTROL)
        except ConnectionError:
            pass

    def _count(self, path: str, nbytes: int) -> None:
        self._bump(f"{path}_transfers")
        self._bump(f"{path}_bytes", nbytes)

    def _bump(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[key] += n


def _say(tensors: dict) -> str:
    return ", ".join(f"{n} {str(dt).removeprefix('torch.')}{list(s)}" for n, (dt, s) in sorted(tensors.items())) or "none"
