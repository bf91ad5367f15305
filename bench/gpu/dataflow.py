"""Hand-off time between two worker processes: the authenticated socket against the device channel.

    python -m bench.gpu.dataflow --device cuda --shape 7b --out DIR      # bench/gpu/dataflow.sh runs this
    python -m bench.gpu.dataflow --device cpu --shape tiny --out DIR     # the same path on CPU (gloo)

Two processes as two workers of one machine, each with a ``SocketTransport`` and a ``DeviceChannel``
(``runtime/workers/device_channel.py``): the sender ("a") sends one message at a time, the receiver
("b") makes its tensors usable on its device (the socket path's host bytes copied over; the
channel's already there), synchronises and acknowledges by socket; the sender times send to
acknowledgement. Two kinds of message, as a worker sends them: a stage's activations (rows x hidden)
and a KV piece (layers x 2 x tokens x KV heads x head dim). Each case runs both paths, interleaved,
``reps`` times after a warm-up; the figure is the median. The channel is gloo on CPU, CUDA IPC where
both processes share one GPU, NCCL with ``--gpus 2``.

``measure(...)`` is the library entry: ``bench/bench_pipeline_round.py`` calls it on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SHAPES = {  # hidden, layers, KV heads, head dim, dtype
    "tiny": (64, 4, 2, 16, "float32"),
    "7b": (4096, 32, 32, 128, "bfloat16"),  # Llama-2-7B
}


@dataclass(frozen=True)
class Case:
    what: str  # "stage" (activations) or "kv" (a KV piece)
    rows: int  # activation rows, or KV tokens
    shape: tuple[int, ...]
    dtype: str

    @property
    def label(self) -> str:
        return f"{self.what} {self.rows} {'rows' if self.what == 'stage' else 'tokens'}"


@dataclass
class Result:
    case: str
    nbytes: int
    socket_ms: float
    channel_ms: float
    channel_kind: str

    @property
    def speedup(self) -> float:
        return self.socket_ms / self.channel_ms


def cases(shape: str, stage_rows=(32, 512, 2048), kv_tokens=(512, 2048)) -> list[Case]:
    hidden, layers, heads, head_dim, dtype = SHAPES[shape]
    out = [Case("stage", r, (r, hidden), dtype) for r in stage_rows]
    out += [Case("kv", t, (layers, 2, t, heads, head_dim), dtype) for t in kv_tokens]
    return out


def measure(case_list: list[Case], device: str = "cpu", reps: int = 5, gpus: int = 1,
            timeout_s: float = 60.0) -> list[Result]:
    """Run the sender in a child process and the receiver here; the results, one per case."""
    import torch.multiprocessing as mp

    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.device_channel import ChannelPeer, DeviceChannel
    from hetserve.runtime.workers.rendezvous import BoundStore
    from hetserve.runtime.workers.transport import SocketTransport

    kind, dev_a, dev_b = _placement(device, gpus)
    security = LinkSecurity.fresh()
    store = BoundStore("127.0.0.1")
    transport = SocketTransport("b", security)
    channel = DeviceChannel(transport, (ChannelPeer("a", kind, "channel/bench/a|b", 1),), dev_b, timeout_s=timeout_s)
    channel.expect.update({k: _expect for k in ("step", "kv")})
    proc = mp.get_context("spawn").Process(target=_sender, daemon=True, args=(
        security.secret, store.address, transport.address, kind, dev_a, case_list, reps, timeout_s))
    proc.start()
    try:
        ready = transport.recv(timeout=120)
        if ready is None or ready.kind != "ready":
            raise RuntimeError(f"the sender did not start: {ready}")
        transport.set_address("a", tuple(ready.meta["address"]))
        channel.connect(store.address, "127.0.0.1")
        rows = _receive(transport, dev_b)
    finally:
        channel.close()
        transport.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        store.close()
    return [Result(**r) for r in rows]


def _placement(device: str, gpus: int) -> tuple[str, str, str]:
    if device == "cpu":
        return "gloo", "cpu", "cpu"
    return ("nccl", "cuda:0", "cuda:1") if gpus > 1 else ("ipc", "cuda:0", "cuda:0")


def _expect(meta: dict) -> dict:
    from hetserve.runtime.workers.wire import DTYPES

    return {meta["name"]: (DTYPES[meta["dtype"]], tuple(meta["shape"]))}


def _receive(transport, device: str) -> list[dict]:
    """Take each message onto the device and acknowledge it; return the sender's results."""
    import torch

    from hetserve.runtime.workers.transport import Priority
    from hetserve.runtime.workers.wire import Message

    dev = torch.device(device)
    while True:
        msg = transport.recv(timeout=600)
        if msg is None:
            raise RuntimeError("the sender went silent")
        if msg.kind == "result":
            return msg.meta["rows"]
        if msg.kind == "error":
            raise RuntimeError(msg.meta["error"])
        for t in msg.tensors.values():
            t = t.to(dev, non_blocking=False)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        transport.send("a", Message("kv_ready", {"i": msg.meta["i"]}), Priority.CONTROL)


def _sender(secret, store_address, receiver, kind, device, case_list, reps, timeout_s) -> None:
    import traceback

    import torch

    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.device_channel import ChannelPeer, DeviceChannel
    from hetserve.runtime.workers.transport import Priority, SocketTransport
    from hetserve.runtime.workers.wire import DTYPES, Message

    torch.set_num_threads(1)
    transport = SocketTransport("a", LinkSecurity(secret))
    transport.set_address("b", receiver)
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        channel = DeviceChannel(transport, (ChannelPeer("b", kind, "channel/bench/a|b", 0),), dev, timeout_s=timeout_s)
        transport.send("b", Message("ready", {"address": list(transport.address)}))
        channel.connect(store_address, "127.0.0.1")
        counter = iter(range(1 << 60))

        def once(case: Case, tensor, path: str) -> float:
            i = next(counter)
            name, msg_kind = ("hidden", "step") if case.what == "stage" else ("kv", "kv")
            msg = Message(msg_kind, {"i": i, "name": name, "shape": list(case.shape), "dtype": case.dtype},
                          {name: tensor})
            began = time.perf_counter()
            (channel.send if path == "channel" else transport.send)("b", msg, Priority.KV)
            ack = transport.recv(timeout=timeout_s + 30)
            if ack is None or ack.meta.get("i") != i:
                raise RuntimeError(f"no acknowledgement of transfer {i} ({path}): {ack}")
            return time.perf_counter() - began

        rows = []
        for case in case_list:
            tensor = torch.randn(case.shape, device=dev).to(DTYPES[case.dtype])
            times: dict[str, list[float]] = {"socket": [], "channel": []}
            for rep in range(reps + 1):  # the first round warms both paths up
                for path, kept in times.items():
                    t = once(case, tensor, path)
                    if rep:
                        kept.append(t)
            nbytes = tensor.numel() * tensor.element_size()
            rows.append(asdict(Result(case.label, nbytes, statistics.median(times["socket"]) * 1e3,
                                      statistics.median(times["channel"]) * 1e3, kind)))
            del tensor
        stats = channel.stats()
        if stats.get("failed") or stats.get("socket_transfers"):
            raise RuntimeError(f"the channel fell back to the socket: {stats}")
        transport.send("b", Message("result", {"rows": rows}))
    except BaseException:  # noqa: BLE001 - reported to the receiver, which raises it
        transport.send("b", Message("error", {"error": traceback.format_exc()}))
    transport.flush(10.0)
    os._exit(0)


def table(results: list[Result], title: str) -> str:
    lines = [f"**{title}**", "",
             "| hand-off | bytes | socket (ms) | socket GB/s | channel (ms) | channel GB/s | channel | speed-up |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        lines.append(f"| {r.case} | {r.nbytes:,} | {r.socket_ms:.3f} | {r.nbytes / r.socket_ms / 1e6:.2f} | "
                     f"{r.channel_ms:.3f} | {r.nbytes / r.channel_ms / 1e6:.2f} | {r.channel_kind} | {r.speedup:.1f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--gpus", type=int, default=1, help="2: the workers on two GPUs (NCCL); 1: one GPU (CUDA IPC)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("out/gpu"))
    args = ap.parse_args()
    import torch

    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    results = measure(cases(args.shape), args.device, args.reps, args.gpus)
    title = (f"hand-off between two worker processes on {device_name} ({'two GPUs' if args.gpus > 1 else 'one device'}), "
             f"{args.shape} shape, median of {args.reps}; socket: device -> host -> authenticated loopback socket -> "
             f"device; channel: {results[0].channel_kind}")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": device_name, "shape": args.shape, "gpus": args.gpus, "reps": args.reps,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "handoffs": [{**asdict(r), "socket_gbps": r.nbytes / r.socket_ms / 1e6,
                            "channel_gbps": r.nbytes / r.channel_ms / 1e6} for r in results]}
    (args.out / "dataflow.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(results, title)
    (args.out / "dataflow.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
