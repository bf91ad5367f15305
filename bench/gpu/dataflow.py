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

``measure(...)`` is the library entry (``bench/bench_pipeline_round.py`` calls it on CPU): it raises
where a case failed. ``run(...)``, which ``main`` uses, keeps going instead: a case that fails is
recorded with its traceback and the next one runs, each row is handed on as it arrives, and the
channel falling back to the socket shows in the rows (``by_socket``) and in both ends' stats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.gpu.results import write_results

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
    by_socket: int = 0  # the channel's sends of this case that went by the socket instead (a fallback)

    @property
    def speedup(self) -> float:
        return self.socket_ms / self.channel_ms


@dataclass
class Measured:
    """What one run measured: a row per hand-off that completed, the failures (a case's or the run's
    traceback), and both ends' ``DeviceChannel.stats()`` (``None`` where that end did not get so far)."""
    results: list[Result] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    @property
    def fell_back(self) -> bool:
        sent = self.stats.get("sender") or {}
        return bool(sent.get("failed") or sent.get("socket_transfers") or any(r.by_socket for r in self.results))


def cases(shape: str, stage_rows=(32, 512, 2048), kv_tokens=(512, 2048)) -> list[Case]:
    hidden, layers, heads, head_dim, dtype = SHAPES[shape]
    out = [Case("stage", r, (r, hidden), dtype) for r in stage_rows]
    out += [Case("kv", t, (layers, 2, t, heads, head_dim), dtype) for t in kv_tokens]
    return out


def measure(case_list: list[Case], device: str = "cpu", reps: int = 5, gpus: int = 1,
            timeout_s: float = 60.0) -> list[Result]:
    """The results, one per case; raises where a case failed or the channel fell back to the socket."""
    m = run(case_list, device, reps, gpus, timeout_s)
    if m.errors or m.fell_back:
        raise RuntimeError(f"hand-offs failed ({[e['case'] for e in m.errors]}) or the channel fell back to the "
                           f"socket: {m.stats}\n" + "\n".join(e["error"] for e in m.errors))
    return m.results


def run(case_list: list[Case], device: str = "cpu", reps: int = 5, gpus: int = 1, timeout_s: float = 60.0,
        on_row: Callable[[Result | None, Measured], None] | None = None) -> Measured:
    """Run the sender in a child process and the receiver here. A case that fails is recorded and the
    next one runs; ``on_row(result or None for an error, measured so far)`` is called as each arrives."""
    import torch.multiprocessing as mp

    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.channel_pairs import ChannelPeer
    from hetserve.runtime.workers.device_channel import DeviceChannel
    from hetserve.runtime.workers.rendezvous import BoundStore
    from hetserve.runtime.workers.transport import SocketTransport

    kind, dev_a, dev_b = _placement(device, gpus)
    measured = Measured()
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
        _receive(transport, dev_b, proc, timeout_s, measured, on_row or (lambda r, m: None))
    except Exception:  # noqa: BLE001 - the run's own failure, kept with what was measured before it
        measured.errors.append({"case": "run", "error": traceback.format_exc()})
        if on_row:
            on_row(None, measured)
    finally:
        measured.stats["receiver"] = channel.stats()
        channel.close()
        transport.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        store.close()
    return measured


def _placement(device: str, gpus: int) -> tuple[str, str, str]:
    if device == "cpu":
        return "gloo", "cpu", "cpu"
    return ("nccl", "cuda:0", "cuda:1") if gpus > 1 else ("ipc", "cuda:0", "cuda:0")


def _expect(meta: dict) -> dict:
    from hetserve.runtime.workers.wire import DTYPES

    return {meta["name"]: (DTYPES[meta["dtype"]], tuple(meta["shape"]))}


def _receive(transport, device: str, proc, timeout_s: float, measured: Measured, on_row) -> None:
    """Take each message onto the device and acknowledge it (with the traceback where that failed);
    keep the sender's results as they arrive (``what``: a ``row``, a ``case_error``), until ``done``."""
    import torch

    from hetserve.runtime.workers.transport import Priority
    from hetserve.runtime.workers.wire import Message

    dev = torch.device(device)
    quiet_since = time.monotonic()
    while True:
        msg = transport.recv(timeout=5)
        if msg is None:
            if not proc.is_alive():
                raise RuntimeError(f"the sender exited (code {proc.exitcode}) before it was done")
            if time.monotonic() - quiet_since > timeout_s + 60:
                raise RuntimeError(f"the sender went silent for {timeout_s + 60:.0f} s")
            continue
        quiet_since = time.monotonic()
        what = msg.meta.get("what") if msg.kind == "result" else None
        if what == "row":
            measured.results.append(Result(**msg.meta["row"]))
            on_row(measured.results[-1], measured)
        elif what == "case_error":
            measured.errors.append({"case": msg.meta["case"], "error": msg.meta["error"]})
            on_row(None, measured)
        elif what == "done":
            measured.stats["sender"] = msg.meta["stats"]
            return
        elif msg.kind == "error":
            raise RuntimeError("the sender failed:\n" + msg.meta["error"])
        else:
            ack = {"i": msg.meta["i"]}
            try:
                for t in msg.tensors.values():
                    t = t.to(dev, non_blocking=False)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception:  # noqa: BLE001 - sent back: the sender records it against its case
                ack["error"] = "receiver: " + traceback.format_exc()
            transport.send("a", Message("kv_ready", ack), Priority.CONTROL)


def _sender(secret, store_address, receiver, kind, device, case_list, reps, timeout_s) -> None:
    import torch

    from hetserve.runtime.workers.auth import LinkSecurity
    from hetserve.runtime.workers.channel_pairs import ChannelPeer
    from hetserve.runtime.workers.device_channel import DeviceChannel
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

        def once(case: Case, tensor, path: str) -> tuple[float, str]:
            i = next(counter)
            name, msg_kind = ("hidden", "step") if case.what == "stage" else ("kv", "kv")
            msg = Message(msg_kind, {"i": i, "name": name, "shape": list(case.shape), "dtype": case.dtype},
                          {name: tensor})
            began = time.perf_counter()
            went = channel.send("b", msg, Priority.KV) if path == "channel" else transport.send("b", msg, Priority.KV)
            deadline = began + timeout_s + 30
            while True:  # acknowledgements of an earlier, failed case's transfers are passed over
                ack = transport.recv(timeout=max(0.0, deadline - time.perf_counter()))
                if ack is None:
                    raise RuntimeError(f"no acknowledgement of transfer {i} ({path})")
                if ack.meta.get("i") == i:
                    break
            if ack.meta.get("error"):
                raise RuntimeError(ack.meta["error"])
            return time.perf_counter() - began, went

        for case in case_list:
            tensor = None
            try:
                tensor = torch.randn(case.shape, device=dev).to(DTYPES[case.dtype])
                times: dict[str, list[float]] = {"socket": [], "channel": []}
                by_socket = 0
                for rep in range(reps + 1):  # the first round warms both paths up
                    for path, kept in times.items():
                        t, went = once(case, tensor, path)
                        by_socket += path == "channel" and went != "channel"
                        if rep:
                            kept.append(t)
                nbytes = tensor.numel() * tensor.element_size()
                row = Result(case.label, nbytes, statistics.median(times["socket"]) * 1e3,
                             statistics.median(times["channel"]) * 1e3, kind, by_socket)
                transport.send("b", Message("result", {"what": "row", "row": asdict(row)}))
            except Exception:  # noqa: BLE001 - recorded against the case; the next one runs
                transport.send("b", Message("result", {"what": "case_error", "case": case.label,
                                                       "error": traceback.format_exc()}))
            finally:
                transport.flush(10.0)  # the case's result is out before the next case can crash this process
                del tensor
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        transport.send("b", Message("result", {"what": "done", "stats": channel.stats()}))
    except BaseException:  # noqa: BLE001 - reported to the receiver, which records it
        transport.send("b", Message("error", {"error": traceback.format_exc()}))
    transport.flush(10.0)
    os._exit(0)


def _row(r: Result) -> str:
    via = r.channel_kind + (f", {r.by_socket} by socket (fell back)" if r.by_socket else "")
    return (f"| {r.case} | {r.nbytes:,} | {r.socket_ms:.3f} | {r.nbytes / r.socket_ms / 1e6:.2f} | "
            f"{r.channel_ms:.3f} | {r.nbytes / r.channel_ms / 1e6:.2f} | {via} | {r.speedup:.1f}x |")


def table(results: list[Result], title: str, errors: list[dict] = ()) -> str:
    lines = [f"**{title}**", "",
             "| hand-off | bytes | socket (ms) | socket GB/s | channel (ms) | channel GB/s | channel | speed-up |",
             "|---|---:|---:|---:|---:|---:|---|---:|"]
    lines += [_row(r) for r in results]
    if errors:
        lines += ["", f"**{len(errors)} error(s)** (tracebacks in dataflow.json):", ""]
        lines += [f"- {e['case']}: {e['error'].strip().splitlines()[-1]}" for e in errors]
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

    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    kind = _placement(args.device, args.gpus)[0]
    title = (f"hand-off between two worker processes on {device_name} ({'two GPUs' if args.gpus > 1 else 'one device'}), "
             f"{args.shape} shape, median of {args.reps}; socket: device -> host -> authenticated loopback socket -> "
             f"device; channel: {kind}")
    report = {"device": device_name, "shape": args.shape, "gpus": args.gpus, "reps": args.reps,
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()), "channel": kind,
              "handoffs": [], "errors": [], "channel_fell_back": False, "channel_stats": {}}

    def save(m: Measured) -> None:
        """Rewrite both files whole (a kill mid-write leaves the previous ones)."""
        report["handoffs"] = [{**asdict(r), "socket_gbps": r.nbytes / r.socket_ms / 1e6,
                               "channel_gbps": r.nbytes / r.channel_ms / 1e6} for r in m.results]
        report["errors"] = list(m.errors)
        report["channel_stats"] = m.stats
        report["channel_fell_back"] = m.fell_back
        write_results(args.out, "dataflow", report, table(m.results, title, m.errors))

    def on_row(r: Result | None, m: Measured) -> None:
        print(_row(r) if r is not None else f"ERROR in {m.errors[-1]['case']}:\n{m.errors[-1]['error']}", flush=True)
        save(m)

    save(Measured())
    print(table([], title), flush=True)
    m = run(cases(args.shape), args.device, args.reps, args.gpus, on_row=on_row)
    if m.fell_back:  # recorded, not raised: the figures measured stay
        m.errors.append({"case": "channel", "error": f"the channel fell back to the socket: {m.stats}"})
    save(m)
    print(table(m.results, title, m.errors))
    failed = [e["case"] for e in m.errors]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
