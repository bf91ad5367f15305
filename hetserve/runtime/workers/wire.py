"""The bytes of one runtime message, and the checks a received one passes before it is used.

A message on the wire is

    >I header length | header (msgpack) | tensor bytes, in the header's order

and the header is a msgpack map ``{kind, src, meta, tensors}``:

- ``kind`` one of ``KINDS``, the messages processes send each other (the kinds an endpoint posts to
  itself — submit, abort, add, … — never travel, so a peer cannot inject them);
- ``meta`` plain data only: None, bool, int, float, str, lists (a tuple arrives as a list), maps,
  and one tagged extension: the dataclasses named in ``_RECORDS``, rebuilt by their constructors
  from plain fields (their sequences as tuples). Nothing on the wire names a function or a class to
  import, so decoding runs no code;
- ``tensors`` ``[name, dtype, shape, nbytes]`` per tensor, the dtype from ``DTYPES``, ``nbytes``
  equal to the shape's element count times the dtype's size, and the byte counts adding up to
  exactly what follows the header.

Messages travel in chunks, each behind ``CHUNK_HEADER`` (message id, offset, total, length), so
chunks of several messages may interleave on one link; ``Reassembly`` puts them back together.

``src`` is the sending endpoint's name, and must be the one its connection's handshake carried
(``check_sender``, as must a ``meta["worker"]``).

A payload or chunk header that breaks any of these raises ``MalformedMessage`` (a ``ValueError``); the transport
closes the connection it came on. Sizes are checked before anything is allocated: the header
against ``MAX_HEADER_BYTES``, each tensor against the payload it claims to be in, each message
against the deployment's largest (``LinkSecurity.max_message_bytes``) before its buffer exists.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from hetserve.runtime.layout import ReplicaSpec, WorkerSpec

# the message kinds that cross a socket; everything else is refused
ENGINE = "engine"  # the coordinator's endpoint name
KINDS = frozenset({"step", "kv", "peers", "shutdown", "kv_cancel",  # engine/peer -> worker
                   # worker -> engine
                   "ready", "result", "kv_ready", "kv_cancelled", "kv_refused", "peers_ack", "heartbeat", "error",
                   "links",  # a worker's link counters (runtime/links/reports.py)
                   "channel_ack"})  # worker -> worker: a device channel's transfer arrived (device_channel.py)
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}
MAX_HEADER_BYTES = 16 << 20  # a step's block tables for hundreds of sequences stay far below
MAX_NAME_BYTES = 256
MAX_PARTIAL_MESSAGES = 1024  # messages one connection may have half-received at once
CHUNK_HEADER = struct.Struct(">QQQI")  # a chunk of a message: msg_id, offset, total, chunk length

_HLEN = struct.Struct(">I")
_RECORD = 2  # msgpack extension code
_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (WorkerSpec, ReplicaSpec)}


class MalformedMessage(ValueError):
    """A received payload that is not a message this runtime sends."""


@dataclass
class Message:
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    src: str = ""  # filled in by the transport on send


# ----------------------------------------------------------------------------- plain data


def _default(obj: Any) -> msgpack.ExtType:
    name = type(obj).__name__
    if _RECORDS.get(name) is type(obj):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_RECORD, pack_data([name, fields]))
    raise TypeError(f"{type(obj).__name__} cannot go on the wire: only plain data and "
                    f"{', '.join(_RECORDS)} (hetserve.runtime.workers.wire)")


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _RECORD:
        name, fields = unpack_data(data)
        cls = _RECORDS.get(name) if isinstance(name, str) else None
        if cls is None or not isinstance(fields, dict):
            raise MalformedMessage(f"unknown record {name!r}")
        try:
            return cls(**{k: _tuples(v) for k, v in fields.items()})
        except TypeError as exc:
            raise MalformedMessage(f"record {name}: {exc}") from None
    raise MalformedMessage(f"unknown extension {code}")


def pack_data(obj: Any) -> bytes:
    """Plain data (see the module docstring) as msgpack bytes; TypeError for anything else."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack_data(data: bytes | memoryview) -> Any:
    """The inverse of ``pack_data``; MalformedMessage for bytes it did not make."""
    try:
        # msgpack bounds every string, array and map by the length of ``data``, itself bounded
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except MalformedMessage:
        raise
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise MalformedMessage(f"undecodable header: {type(exc).__name__}: {exc}") from None


# ----------------------------------------------------------------------------- messages


def encode(msg: Message) -> list[memoryview]:
    """Message -> buffers [length + header, tensor bytes...]; tensors are copied, so the caller may reuse them."""
    specs, bufs = [], []
    for name, t in msg.tensors.items():
        t = t.detach().to("cpu", copy=True).contiguous()
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()])
        bufs.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b""))
    header = pack_data({"kind": msg.kind, "src": msg.src, "meta": msg.meta, "tensors": specs})
    return [memoryview(_HLEN.pack(len(header)) + header)] + bufs


def decode(payload: bytearray) -> Message:
    """Bytes from ``encode`` -> Message, tensors viewing ``payload``; MalformedMessage for anything else."""
    if len(payload) < _HLEN.size:
        raise MalformedMessage(f"{len(payload)} bytes: shorter than a header length")
    (hlen,) = _HLEN.unpack_from(payload, 0)
    if hlen > min(MAX_HEADER_BYTES, len(payload) - _HLEN.size):
        raise MalformedMessage(f"header of {hlen} bytes in a payload of {len(payload)}")
    header = unpack_data(memoryview(payload)[_HLEN.size:_HLEN.size + hlen])
    kind, src, meta, specs = _check_header(header)
    offset, tensors = _HLEN.size + hlen, {}
    for name, dtype, shape, nbytes in specs:
        if offset + nbytes > len(payload):
            raise MalformedMessage(f"tensor {name!r} ({nbytes} bytes) runs past the payload's {len(payload)}")
        dt = DTYPES[dtype]
        if nbytes:
            tensors[name] = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset).view(dt).reshape(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dt)
        offset += nbytes
    if offset != len(payload):
        raise MalformedMessage(f"{len(payload) - offset} bytes after the last tensor")
    return Message(kind, meta, tensors, src)


def check_sender(msg: Message, peer: str) -> None:
    """MalformedMessage unless ``msg`` names as its sender ``peer``, the name its connection's handshake
    carried: in ``src``, and in ``meta["worker"]`` where it has one (a worker's messages to the engine
    name the worker there). Every endpoint sends under its own name (the transport sets ``src``; a
    worker's ``worker`` is its endpoint's name), so one connection speaks for one endpoint."""
    if msg.src != peer:
        raise MalformedMessage(f"a {msg.kind!r} message from {msg.src!r:.80} on a connection of {peer!r:.80}")
    if msg.meta.get("worker", peer) != peer:
        raise MalformedMessage(f"a {msg.kind!r} message naming worker {msg.meta['worker']!r:.80} "
                               f"on a connection of {peer!r:.80}")


def _check_header(header: Any) -> tuple[str, str, dict, list]:
    if not isinstance(header, dict) or set(header) != {"kind", "src", "meta", "tensors"}:
        raise MalformedMessage("the header is not a map of kind, src, meta, tensors")
    kind, src, meta, specs = header["kind"], header["src"], header["meta"], header["tensors"]
    if kind not in KINDS:
        raise MalformedMessage(f"unknown message kind {kind!r}")
    if not isinstance(src, str) or len(src) > MAX_NAME_BYTES or not isinstance(meta, dict):
        raise MalformedMessage("src must be a short string and meta a map")
    if not isinstance(specs, list):
        raise MalformedMessage("tensors must be a list")
    for spec in specs:
        check_tensor_spec(spec)
    return kind, src, meta, specs


def check_tensor_spec(spec: Any) -> None:
    """``[name, dtype, shape, nbytes]`` as ``encode`` writes it; MalformedMessage otherwise."""
    ok = (isinstance(spec, list) and len(spec) == 4 and isinstance(spec[0], str) and spec[1] in DTYPES
          and isinstance(spec[2], list) and all(type(d) is int and d >= 0 for d in spec[2])
          and type(spec[3]) is int)
    if not ok:
        raise MalformedMessage(f"a tensor entry must be [name, dtype of {sorted(DTYPES)}, shape, bytes], got {spec!r:.200}")
    name, dtype, shape, nbytes = spec
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes != expected:
        raise MalformedMessage(f"tensor {name!r}: {nbytes} bytes for shape {shape} of {dtype} ({expected})")


# ----------------------------------------------------------------------------- chunks


class Reassembly:
    """Chunks of the messages one connection carries, put back together; every chunk header is checked
    before its bytes are read or a buffer is allocated for them."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self.partial: dict[int, bytearray] = {}
        self.received: dict[int, int] = {}

    def chunk(self, msg_id: int, offset: int, total: int, length: int) -> memoryview:
        """Where the chunk's ``length`` bytes go; MalformedMessage for a header no sender writes."""
        if total > self.max_message_bytes:
            raise MalformedMessage(f"a message of {total} bytes (this deployment's bound: {self.max_message_bytes})")
        if offset + length > total or (length == 0 and total > 0):
            raise MalformedMessage(f"a chunk of {length} bytes at {offset} of a {total}-byte message")
        buf = self.partial.get(msg_id)
        if buf is None:
            if len(self.partial) >= MAX_PARTIAL_MESSAGES:
                raise MalformedMessage(f"more than {MAX_PARTIAL_MESSAGES} messages half-received")
            buf = self.partial[msg_id] = bytearray(total)
            self.received[msg_id] = 0
        elif len(buf) != total:
            raise MalformedMessage(f"message {msg_id} announced as {len(buf)} and {total} bytes")
        if self.received[msg_id] + length > total:
            raise MalformedMessage(f"message {msg_id}: more bytes than announced")
        return memoryview(buf)[offset:offset + length]

    def complete(self, msg_id: int, length: int) -> bytearray | None:
        """The whole payload once its last chunk is in, else None."""
        self.received[msg_id] += length
        if self.received[msg_id] < len(self.partial[msg_id]):
            return None
        del self.received[msg_id]
        return self.partial.pop(msg_id)


def read_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (EOFError if the peer closes first)."""
    buf = bytearray(n)
    read_into(sock, memoryview(buf))
    return bytes(buf)


def read_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (EOFError if the peer closes first)."""
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise EOFError("connection closed")
        view = view[got:]
