"""A worker process: one device, one TP rank of one pipeline stage of one replica.

Control path (one for every TP degree, as nano-vllm): the stage leader (TP rank 0) takes the next
message, broadcasts it to its TP group, and every rank runs the same method. Activations enter a
stage only at its leader (from the coordinator for the first stage, from the previous stage's
leader otherwise) and are broadcast to the group (HexGen §3.2); the leader of the last stage samples
and sends the tokens to the coordinator.

Messages a worker receives:

    step      {step, seqs: [(seq_id, start, q_len, block_table, sample_key, extra)], handoffs, priority}
              (``extra``: None, or {history, targets, k}: ``Sequence.step_extra``)
              (+ input_ids for the first stage, hidden for the others); leaders only
    kv        one piece of a KV hand-off, written into the pool on the receiving thread; when all
              pieces of a request are in, the worker tells the coordinator ``kv_ready``
    peers     the address book; answered with ``peers_ack``
    shutdown  leaders only; broadcast to the group, then every rank exits

Sent to the coordinator: ``ready`` (after loading), ``result`` (last leader), ``kv_ready``,
``kv_refused`` (a hand-off to a replica this worker's layout does not hold, or a received piece
that could not be written: the request re-runs),
``error`` (traceback, just before exiting on any exception; ``worker_process.py`` sends it, with
the heartbeats, from the process around this ``Worker``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hetserve.runtime import kernels
from hetserve.runtime.layout import KVTransfer, ReplicaSpec, WorkerSpec, kv_transfers
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.loader import load_stage
from hetserve.runtime.model.runner import StepRunner
from hetserve.runtime.sampling import sample, token_logprobs, wants_logprobs
from hetserve.runtime.workers.auth import LinkSecurity
from hetserve.runtime.workers.channel_pairs import ChannelPeer
from hetserve.runtime.workers.device_channel import DeviceChannel
from hetserve.runtime.workers.kv_pool import KVPool, slots_of
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import Message, pack_data, unpack_data

log = logging.getLogger(__name__)
ENGINE = "engine"  # the coordinator's endpoint name
HEARTBEAT_S = 20.0  # an idle leader pings its TP group this often, well inside the group timeout
GROUP_TIMEOUT_S = 300.0
KV_DONE_KEPT = 4096  # hand-offs remembered as complete, to drop their pieces that come again
KV_NOT_INSTALLED = "KV piece not installed: hand-off"  # the log line's fixed words: a GPU check greps for them


@dataclass(frozen=True)
class WorkerConfig:
    spec: WorkerSpec
    layout: tuple[ReplicaSpec, ...]
    model_dir: str
    dtype: str
    num_slots: int  # KV pool slots (same for every worker of a replica)
    block_size: int
    engine_address: tuple[str, int]
    security: LinkSecurity  # the deployment's secret and bounds, shared by every endpoint (runtime/workers/auth.py)
    store_address: tuple[str, int] | None  # TCPStore for TP groups
    backend: str = "gloo"  # TP group backend: nccl when the stage's GPUs are distinct, else gloo
    link_scheduler: Any = None  # picklable factory (src, dst) -> LinkScheduler; None: PriorityScheduler
    shaper: Any = None  # picklable LinkShaper; None: no shaping
    heartbeat_s: float = 0.5  # how often this worker tells the coordinator it is alive (0: never)
    host: str = "127.0.0.1"  # the address this worker binds and advertises: its node's (rendezvous.py)
    threads: int = 1  # torch intra-op threads of this worker process (the engine divides a host's cores)
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (on CUDA, where the stage's collectives allow)
    max_graph_batch: int = 256  # the largest decode batch the step runner pads and captures
    channels: tuple[ChannelPeer, ...] = ()  # device channels to peers (channel_pairs.channel_pairs); () : sockets
    channel_timeout_s: float = 30.0  # a channel transfer not done by then goes by socket


class Worker:
    def __init__(self, cfg: WorkerConfig, transport: SocketTransport):
        self.cfg, self.spec, self.transport = cfg, cfg.spec, transport
        spec = cfg.spec
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.tp = spec.tp_world > 1
        if self.tp:
            self._init_group()
        self.arch = ArchConfig.from_dir(cfg.model_dir)
        self.model, self.load_report = load_stage(self.arch, cfg.model_dir, spec.layers,
                                                  has_embed=spec.is_first and spec.is_leader,
                                                  has_head=spec.is_last and spec.is_leader, tp_rank=spec.tp_rank,
                                                  tp_world=spec.tp_world, device=self.device, dtype=self.dtype)
        self.pool = KVPool(spec.layers[1] - spec.layers[0], cfg.num_slots, spec.kv_heads[1] - spec.kv_heads[0],
                           self.arch.head_dim, self.dtype, self.device)
        self.kv_layers = self.pool.layers()
        self.runner = self._make_runner()
        # hand-off pieces this worker sends, per destination replica, and how many each receiver expects
        self.layout = cfg.layout
        self.sends = self._plan_sends()
        # per hand-off, the pieces in so far, by (sender, layers, heads): they arrive on one receiving
        # thread per sender. A piece that comes twice (a device channel resending what it had delivered)
        # is dropped and counted: counted twice, it would report a hand-off complete with a piece missing
        self.kv_received: dict[int, set[tuple]] = {}
        self.kv_done: dict[int, None] = {}  # the latest hand-offs completed here (KV_DONE_KEPT), oldest first
        self.kv_duplicates = 0
        self.kv_cancelled: dict[int, None] = {}  # the latest hand-offs the coordinator abandoned (KV_DONE_KEPT)
        self.kv_fenced = 0  # pieces of those that arrived after all and were dropped
        self._kv_lock = threading.Lock()
        transport.on_message = self._on_message  # KV and peers are handled on the receiving thread
        self.channel = self._open_channel() if cfg.channels else None
        # KV hand-offs are copied into the pool on their own stream: the copy need not wait for the
        # step in flight, and the receiving thread waits for its own copy only (never the device)
        self._install_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # every CUDA graph before "ready": no peer knows this worker yet, so no receiving thread
        # touches the device while a graph is captured (runner.py)
        with torch.inference_mode():  # as the steps run
            self.runner.capture_all()
        load = {**self.load_report.as_dict(), "graphs": self.runner.graph_note,
                "kernels": kernels.describe(self.device)}
        transport.send(ENGINE, Message("ready", {"worker": spec.name, "address": transport.address,
                                                 "pid": os.getpid(), "load": load}))

    def _make_runner(self) -> StepRunner:
        cfg = self.cfg
        # a captured all-reduce needs NCCL: a gloo TP group (CPU, or ranks sharing a GPU) runs eagerly
        graphs = cfg.cuda_graphs and not (self.tp and cfg.backend != "nccl")
        if cfg.cuda_graphs and self.device.type == "cuda" and not graphs:
            log.warning("%s: CUDA graphs off, the TP group's %s all-reduce cannot be captured",
                        self.spec.name, cfg.backend)
        max_blocks = min(cfg.num_slots // cfg.block_size, -(-self.arch.max_positions // cfg.block_size))
        return StepRunner(self.model, self.kv_layers, cfg.block_size, self.arch.hidden_size, self.dtype,
                          self.device, max_batch=cfg.max_graph_batch, max_blocks=max(1, max_blocks), graphs=graphs)

    def _open_channel(self) -> DeviceChannel:
        """Device channels to the workers this one exchanges activations or KV pieces with; each
        received header must match what the step or the piece needs here."""
        channel = DeviceChannel(self.transport, self.cfg.channels, self.device, self.cfg.channel_timeout_s)
        channel.expect["step"] = lambda m: {"hidden": (self.dtype, (sum(s[2] for s in m["seqs"]),
                                                                    self.arch.hidden_size))}
        channel.expect["kv"] = self._kv_expected
        channel.connect(self.cfg.store_address, self.cfg.host)
        return channel

    def _kv_expected(self, m: dict) -> dict:
        (a, b), (h0, h1) = m["layers"], m["heads"]
        (la, lb), (ha, hb) = self.spec.layers, self.spec.kv_heads
        if not (la <= a < b <= lb and ha <= h0 < h1 <= hb and type(m["num_tokens"]) is int):
            raise ValueError(f"a KV piece of layers {a}-{b}, heads {h0}-{h1} for a worker of {la}-{lb}, {ha}-{hb}")
        return {"kv": (self.dtype, (b - a, 2, m["num_tokens"], h1 - h0, self.arch.head_dim))}

    def _send(self, peer: str, msg: Message, priority: Priority) -> None:
        """To another worker: by its device channel where there is one, else by socket."""
        (self.channel.send if self.channel is not None else self.transport.send)(peer, msg, priority)

    def _replica(self, rid: str) -> ReplicaSpec:
        return next(r for r in self.layout if r.id == rid)

    def _plan_sends(self) -> dict[str, list[tuple[KVTransfer, int]]]:
        sends: dict[str, list[tuple[KVTransfer, int]]] = {}
        # whatever this replica's role: the coordinator decides who hands off, and a re-plan may turn
        # a replica that started colocated (or decode) into a prefill replica without restarting it
        for dst in self.layout:
            if dst.serves_decode and dst.id != self.spec.replica:
                pieces = kv_transfers(self._replica(self.spec.replica), dst)
                expect = {w.name: sum(p.dst == w.name for p in pieces) for w in dst.workers}
                sends[dst.id] = [(p, expect[p.dst]) for p in pieces if p.src == self.spec.name]
        return sends

    def _init_group(self) -> None:
        from hetserve.runtime.workers.rendezvous import init_tp_group

        init_tp_group(self.cfg.backend, self.cfg.store_address, f"{self.spec.replica}/stage{self.spec.stage}",
                      self.spec.tp_rank, self.spec.tp_world, self.cfg.host, GROUP_TIMEOUT_S)

    # ------------------------------------------------------------------ receiving thread
    def _on_message(self, msg: Message) -> bool:
        """KV pieces and the address book are handled here; steps go to the inbox for the step loop."""
        if msg.kind == "kv":
            try:
                self._install_kv(msg)
            except Exception as exc:  # noqa: BLE001 - the receiving thread must live on for later pieces
                self._refuse_kv(msg, exc)
            return True
        if msg.kind == "kv_cancel":
            if msg.src == ENGINE:  # only the coordinator abandons a hand-off
                self._cancel_kv(int(msg.meta["seq"]))
            return True
        if msg.kind == "peers":
            for name, addr in msg.meta["addresses"].items():
                if name != self.spec.name:
                    self.transport.set_address(name, addr)
            if "layout" in msg.meta:  # a re-plan added replicas: hand-offs may now go to new decode replicas
                self.layout = msg.meta["layout"]
                self.sends = self._plan_sends()
            self.transport.send(ENGINE, Message("peers_ack", {"worker": self.spec.name}))
            return True
        return False

    def _install_kv(self, msg: Message) -> None:
        """Write a received piece into the pool. Checked and written under ``_kv_lock``, so once
        ``_cancel_kv`` has run for a hand-off none of its pieces writes any more."""
        m = msg.meta
        seq, piece = m["seq"], (msg.src, tuple(m["layers"]), tuple(m["heads"]))
        first, h0 = self.spec.layers[0], self.spec.kv_heads[0]
        layers = slice(m["layers"][0] - first, m["layers"][1] - first)
        heads = slice(m["heads"][0] - h0, m["heads"][1] - h0)
        with self._kv_lock:
            if seq in self.kv_cancelled:
                self.kv_fenced += 1
                return
            if seq in self.kv_done or piece in self.kv_received.get(seq, ()):
                self.kv_duplicates += 1
                return
            slots = slots_of(m["table"], m["num_tokens"], self.cfg.block_size)
            if self._install_stream is None:
                self.pool.write(layers, heads, slots, msg.tensors["kv"])
            else:
                # a piece that came by device channel is complete on the device already (its receive
                # waited for it); the stream's temporaries are freed only after the wait below
                with torch.cuda.stream(self._install_stream):
                    self.pool.write(layers, heads, slots, msg.tensors["kv"])
                self._install_stream.synchronize()  # the bytes are in place before the coordinator hears so
            self.runner.pool_written(slots)
            got = self.kv_received.setdefault(seq, set())
            got.add(piece)
            complete = len(got) == m["expect"]
            if complete:
                self.kv_received.pop(seq)
                _remember(self.kv_done, seq)
        if complete:
            self.transport.send(ENGINE, Message("kv_ready", {"seq": seq, "worker": self.spec.name}))

    def _refuse_kv(self, msg: Message, exc: Exception) -> None:
        """A piece that could not be written (a device error, a malformed table): the coordinator
        re-runs its request from the prompt and fences the hand-off's blocks, as for a sender's
        refusal; its other pieces are dropped when they come (``kv_cancel``)."""
        seq = msg.meta.get("seq")
        log.warning("%s: %s %s from %s (%s: %s); refused, its request re-runs", self.spec.name, KV_NOT_INSTALLED,
                    seq, msg.src, type(exc).__name__, exc)
        if type(seq) is not int:
            return  # no hand-off of the coordinator's: nothing to re-run
        try:
            self.transport.send(ENGINE, Message("kv_refused", {"seq": seq, "worker": self.spec.name,
                                                               "reason": f"{KV_NOT_INSTALLED}: {exc}"[:500]}))
        except ConnectionError:
            pass  # this endpoint is closing

    def _cancel_kv(self, seq: int) -> None:
        """The coordinator abandoned hand-off ``seq`` (its sender died or left the plan) and will give
        its blocks to other requests once every receiver says so: from here on its pieces still on
        their way (a dead sender's socket may deliver after it is gone) are dropped, not written."""
        with self._kv_lock:
            self.kv_received.pop(seq, None)
            _remember(self.kv_cancelled, seq)
        self.transport.send(ENGINE, Message("kv_cancelled", {"seq": seq, "worker": self.spec.name}),
                            Priority.CONTROL)

    # ------------------------------------------------------------------ step loop
    def run(self) -> None:
        while True:
            kind, meta, hidden = self._next()
            if kind == "shutdown":
                return
            if kind in ("noop", "link_error"):
                # link_error: the transport could not reach a peer (a decode worker that died mid
                # hand-off). The engine notices dead workers itself (exit poll, heartbeats) and
                # abandons or re-runs what they held; this worker must live on to serve the re-run.
                continue
            with torch.inference_mode():
                began = (time.perf_counter(), time.thread_time())  # this stage's part of the step, wall and CPU
                self._send_kv(meta["handoffs"])
                if meta["seqs"]:
                    self._compute(meta, hidden, began)  # forwards to the next stage itself
                elif self.spec.is_leader and not self.spec.is_last:  # hand-off only: pass it down the pipeline
                    self.transport.send(self.spec.next_leader, Message("step", meta), Priority.CONTROL)

    def _next(self) -> tuple[str, dict, torch.Tensor | None]:
        """Leader: take the next message; every rank: agree on it (broadcast within the TP group)."""
        msg = None
        if self.spec.is_leader:
            msg = self.transport.recv(timeout=HEARTBEAT_S) or Message("noop")
        if not self.tp:
            return msg.kind, msg.meta, msg.tensors.get("hidden", msg.tensors.get("input_ids"))
        kind, meta = _broadcast_header(msg.kind, msg.meta) if msg else _broadcast_header()
        tensor = (msg.tensors.get("hidden", msg.tensors.get("input_ids")) if msg else None)
        return kind, meta, tensor

    def _compute(self, meta: dict, received: torch.Tensor | None, began: tuple[float, float]) -> None:
        spec = self.spec
        seqs = meta["seqs"]
        step = self.runner.prepare([s[1] for s in seqs], [s[2] for s in seqs], [s[3] for s in seqs])
        am, T = step.meta, step.num_tokens
        if spec.is_leader:
            if spec.is_first:
                h = self.model.embed(_to(received, self.device), am.positions[:T])  # (T, H)
            else:
                h = _to(received, self.device).to(self.dtype)  # (T, H)
        else:
            h = torch.empty(T, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        if self.tp:
            import torch.distributed as dist

            dist.broadcast(h, src=0)
        h = self.runner.run(step, h)
        if not spec.is_leader:
            return
        if spec.is_last:
            logits = self.model.logits(h[am.last_token[:len(seqs)]])  # (B, V)
            extras = [s[5] if len(s) > 5 else None for s in seqs]
            keys = [s[4] for s in seqs]
            tokens = sample(logits, keys, [e.get("history") if e else None for e in extras])
            out = {"tokens": tokens}
            k = wants_logprobs(keys)
            if k >= 0:  # every row gets the widest k; the coordinator keeps each request's own
                out["lp"], out["top_ids"], out["top_lps"] = token_logprobs(logits, tokens, k)
            out.update(self._prompt_logprobs(h, seqs, extras))
            spent = _spent(meta, began, self.device)
            self.transport.send(ENGINE, Message("result", {"step": meta["step"], **spent}, out))
        else:
            meta.update(_spent(meta, began, self.device))  # the next stage adds its own
            self._send(spec.next_leader, Message("step", meta, {"hidden": h}), Priority(meta["priority"]))

    def _prompt_logprobs(self, h: torch.Tensor, seqs: list, extras: list) -> dict[str, torch.Tensor]:
        """Logprobs of the prompt tokens this step fed, for the sequences that ask (``targets``): the
        rows of each one's positions, in ``seqs`` order, concatenated. Only these rows go through the
        LM head, so a step that asks for none pays nothing."""
        rows, targets, k, first = [], [], 0, 0
        for s, e in zip(seqs, extras):
            if e and e.get("targets"):
                rows.extend(range(first, first + len(e["targets"])))
                targets.extend(e["targets"])
                k = max(k, int(e.get("k", 0)))
            first += s[2]  # the next sequence's first row in the step
        if not rows:
            return {}
        logits = self.model.logits(h[torch.tensor(rows, device=h.device)])  # (N, V)
        lp, ids, lps = token_logprobs(logits, torch.tensor(targets), k)
        return {"p_lp": lp, "p_top_ids": ids, "p_top_lps": lps}

    def _send_kv(self, handoffs: list) -> None:
        """Send this worker's pieces of each hand-off (its layers x its KV heads) to the decode workers."""
        first, h0 = self.spec.layers[0], self.spec.kv_heads[0]
        for seq, src_table, num_tokens, dst, dst_table in handoffs:
            sends = self.sends.get(dst)
            if sends is None:  # not a decode replica of this worker's layout: the request must not wait
                reason = f"{dst!r} is not a decode replica in the layout of worker {self.spec.name}"
                self.transport.send(ENGINE, Message("kv_refused", {"seq": seq, "worker": self.spec.name,
                                                                   "reason": reason}))
                continue
            slots = slots_of(src_table, num_tokens, self.cfg.block_size)
            for piece, expect in sends:
                kv = self.pool.read(slice(piece.layers[0] - first, piece.layers[1] - first),
                                    slice(piece.heads[0] - h0, piece.heads[1] - h0), slots)
                meta = {"seq": seq, "layers": piece.layers, "heads": piece.heads, "table": dst_table,
                        "num_tokens": num_tokens, "expect": expect}
                self._send(piece.dst, Message("kv", meta, {"kv": kv}), Priority.KV)


def _remember(seen: dict[int, None], seq: int) -> None:
    """Add hand-off ``seq`` to ``seen``, forgetting the oldest past ``KV_DONE_KEPT``."""
    seen[seq] = None
    if len(seen) > KV_DONE_KEPT:
        del seen[next(iter(seen))]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A received host tensor on ``device``; to a GPU from pinned memory, without blocking the host."""
    if device.type != "cuda" or t.device.type == "cuda":  # a device channel's tensors are there already
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _broadcast_header(kind: str = "", meta: dict | None = None) -> tuple[str, dict]:
    """The leader's (kind, meta) on every rank of its TP group, as wire data (no pickle: a TP
    group's connections are no more trusted than the runtime's sockets)."""
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    if meta is not None:
        data = torch.frombuffer(bytearray(pack_data([kind, meta])), dtype=torch.uint8)
        size[0] = data.numel()
    dist.broadcast(size, src=0)
    if meta is None:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    kind, meta = unpack_data(data.numpy().tobytes())
    return kind, meta


def _spent(meta: dict, began: tuple[float, float], device: torch.device) -> dict[str, float]:
    """The step's worker time so far: the earlier stage leaders' (in ``meta``) plus this one's since
    ``began`` (wall, and CPU of this thread: less than wall where the OS ran something else here).
    The coordinator keeps the last stage's total beside its own span (``StepTiming.worker_s``).

    On a GPU the clock stops once the stage's work on its stream is done: the host gets here with
    the forward only queued (a device channel sends activations without reading them back). The
    wait costs nothing where the host reads the result anyway (the last stage's sampled tokens, a
    socket send's copy to the host)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return {"worker_s": meta.get("worker_s", 0.0) + time.perf_counter() - began[0],
            "worker_cpu_s": meta.get("worker_cpu_s", 0.0) + time.thread_time() - began[1]}
