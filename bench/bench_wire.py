"""What authentication and the checked wire format cost the runtime's links, against baselines in the same run.

    .venv/bin/python -m bench.bench_wire [--repeats 2000]

- *connection*: a TCP connection to a ``SocketTransport`` endpoint with the handshake (a greeting,
  two HMAC-SHA256 proofs) against a bare TCP connect + first byte to a plain listener on the same
  loopback, median over ``--repeats / 10`` connections each. Target: the handshake adds <= 1 ms.
- *message*: encode + decode of the messages a decode step sends (a step of 32 sequences with
  their block tables and input ids; a stage's activations; a sampled result), median over
  ``--repeats``, against the same message with a pickled header (the format the runtime used
  before, rebuilt here as the baseline). Target: nothing measurable next to the step itself.
- *round trip*: one step message between two endpoints over loopback and its result back, median.

Every figure is measured on this machine, in this run.
"""

from __future__ import annotations

import argparse
import pickle
import socket
import struct
import threading

import torch

from bench.lib.console import wide_console
from bench.lib.timing import median_us
from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import Message, decode, encode


def step_messages() -> dict[str, Message]:
    seqs = [(i, 100 + i, 1, list(range(i * 8, i * 8 + 8)), (0.7, 1.0, 1234 + i, 100)) for i in range(32)]
    return {
        "step, 32 seqs": Message("step", {"step": 7, "seqs": seqs, "handoffs": [], "priority": 1},
                                 {"input_ids": torch.arange(32)}),
        "activations 32x4096": Message("step", {"step": 7, "seqs": seqs, "handoffs": [], "priority": 1,
                                                "worker_s": 0.01, "worker_cpu_s": 0.01},
                                       {"hidden": torch.zeros(32, 4096)}),
        "result": Message("result", {"step": 7, "worker_s": 0.01, "worker_cpu_s": 0.01},
                          {"tokens": torch.arange(32)}),
    }


def _pickled(msg: Message) -> tuple[bytes, list[memoryview]]:
    """The baseline: the same frame with a pickled header, and its decode."""
    specs, bufs = [], []
    for name, t in msg.tensors.items():
        t = t.detach().to("cpu", copy=True).contiguous()
        specs.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
        bufs.append(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    header = pickle.dumps((msg.kind, msg.meta, msg.src, specs), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack(">I", len(header)) + header, bufs


def _unpickled(payload: bytearray) -> Message:
    (hlen,) = struct.unpack_from(">I", payload, 0)
    kind, meta, src, specs = pickle.loads(memoryview(payload)[4:4 + hlen])
    offset, tensors = 4 + hlen, {}
    for name, dtype, shape, nbytes in specs:
        tensors[name] = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset).view(
            getattr(torch, dtype)).reshape(shape)
        offset += nbytes
    return Message(kind, meta, tensors, src)


def codec_rows(repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, msg in step_messages().items():
        def checked():
            decode(bytearray(b"".join(encode(msg))))

        def pickled():
            head, bufs = _pickled(msg)
            _unpickled(bytearray(b"".join([head, *bufs])))

        pickled_us = median_us(pickled, repeats)
        checked_us = median_us(checked, repeats)
        rows.append((name, checked_us, pickled_us))
    return rows


def connection_row(repeats: int) -> tuple[float, float]:
    """(median handshake connection, median bare connection) in microseconds."""
    security = LinkSecurity.fresh()
    server = SocketTransport("server", security)
    from hetserve.runtime.workers.auth import connect_handshake

    def handshake():
        with socket.create_connection(server.address) as s:
            connect_handshake(s, security, "client")

    plain = socket.create_server(("127.0.0.1", 0))

    def serve_plain():
        while True:
            try:
                c, _ = plain.accept()
            except OSError:
                return
            c.sendall(b"x")
            c.close()

    threading.Thread(target=serve_plain, daemon=True).start()

    def bare():
        with socket.create_connection(plain.getsockname()) as s:
            s.recv(1)

    try:
        return median_us(handshake, repeats), median_us(bare, repeats)
    finally:
        server.close()
        plain.close()


def round_trip_us(repeats: int) -> float:
    security = LinkSecurity.fresh()
    a, b = SocketTransport("engine", security), SocketTransport("worker", security)
    a.set_address("worker", b.address)
    b.set_address("engine", a.address)
    msgs = step_messages()

    def once():
        a.send("worker", msgs["step, 32 seqs"], Priority.DECODE)
        b.recv(timeout=5)
        b.send("engine", msgs["result"])
        a.recv(timeout=5)

    once()
    try:
        return median_us(once, repeats)
    finally:
        a.close()
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2000, help="timed repeats per message (connections: a tenth)")
    args = ap.parse_args()
    console = wide_console()
    hs, bare = connection_row(max(10, args.repeats // 10))
    console.print(f"connection (median of {max(10, args.repeats // 10)}, measured): handshake {hs:.0f} us, "
                  f"bare TCP connect {bare:.0f} us: the handshake adds {(hs - bare) / 1000:.3f} ms (target <= 1 ms)")
    from rich.table import Table

    table = Table(title=f"encode + decode per message, median of {args.repeats} (measured, this machine)")
    for col in ("message", "checked msgpack header (us)", "pickled header, baseline (us)", "difference (us)"):
        table.add_column(col, justify="right")
    for name, checked, pickled in codec_rows(args.repeats):
        table.add_row(name, f"{checked:.1f}", f"{pickled:.1f}", f"{checked - pickled:+.1f}")
    console.print(table)
    console.print(f"step + result round trip over loopback: {round_trip_us(max(10, args.repeats // 10)):.0f} us "
                  "(median, measured)")


if __name__ == "__main__":
    main()
