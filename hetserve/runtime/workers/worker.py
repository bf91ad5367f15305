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
from hetserve.runtime.workers.kv_receiver import KVReceiver
from hetserve.runtime.workers.transport import Priority, SocketTransport
from hetserve.runtime.workers.wire import ENGINE, Message, pack_data, unpack_data

log = logging.getLogger(__name__)
HEARTBEAT_S = 20.0  # an idle leader pings its TP group this often, well inside the group timeout
GROUP_TIMEOUT_S = 300.0


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
    port_range: Any = None  # rendezvous.PortRange its endpoint takes a port from; None: the OS picks
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
        self.kv = KVReceiver(spec.name, spec.layers, spec.kv_heads, self.pool, cfg.block_size, transport.send,
                             self.runner.pool_written, self.device)
        transport.on_message = self._on_message  # KV and peers are handled on the receiving thread
        self.channel = self._open_channel() if cfg.channels else None
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
        graphs, why_not = decode_graphs(cfg, self.tp)
        if cfg.cuda_graphs and not graphs and self.device.type == "cuda":  # a slower path than planned
            log.warning("%s: CUDA graphs off: %s", self.spec.name, why_not)
        max_blocks = min(cfg.num_slots // cfg.block_size, -(-self.arch.max_positions // cfg.block_size))
        return StepRunner(self.model, self.kv_layers, cfg.block_size, self.arch.hidden_size, self.dtype,
                          self.device, max_batch=cfg.max_graph_batch, max_blocks=max(1, max_blocks), graphs=graphs,
                          off_why=why_not)

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
            self.kv.on_piece(msg)
            return True
        if msg.kind == "kv_cancel":
            if msg.src == ENGINE:  # only the coordinator abandons a hand-off
                self.kv.cancel(int(msg.meta["seq"]))
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
            spent = _spent(meta, began, self.device, wait=True)
            self.transport.send(ENGINE, Message("result", {"step": meta["step"], **spent}, out))
        else:
            # the next stage adds its own; a device channel hands the activations on without the host
            # reading them, so waiting for the GPU there would only hold the host from queueing more
            on_device = self.channel is not None and self.channel.on_device(spec.next_leader,
                                                                            h.numel() * h.element_size())
            meta.update(_spent(meta, began, self.device, wait=not on_device))
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


def decode_graphs(cfg: WorkerConfig, tp: bool) -> tuple[bool, str]:
    """Whether a worker captures its decode steps as CUDA graphs, and why not where it does not: a
    captured all-reduce needs NCCL (a gloo TP group, on CPU or ranks sharing a GPU, runs eagerly).
    A prefill replica's workers capture too: a failover or re-plan that has them decode (the last
    decode replica gone, ``recovery.py``) then decodes at the graphs' pace."""
    if not cfg.cuda_graphs:
        return False, "not asked"
    if tp and cfg.backend != "nccl":
        return False, f"the TP group's all-reduce cannot be captured: a {cfg.backend} all-reduce"
    return True, ""


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


def _spent(meta: dict, began: tuple[float, float], device: torch.device, wait: bool) -> dict[str, float]:
    """The step's worker time so far: the earlier stage leaders' (in ``meta``) plus this one's since
    ``began`` (wall, and CPU of this thread: less than wall where the OS ran something else here).
    The coordinator keeps the last stage's total beside its own span (``StepTiming.worker_s``).

    The host gets here with the forward only queued on a GPU: with ``wait`` the clock stops once the
    stage's stream is done, which costs nothing where the host reads the result next anyway (the
    last stage's sampled tokens, a socket send's copy to the host). Without it (a device channel
    carries the activations on) the figure is the host's time, the GPU's work maybe still queued."""
    if wait and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return {"worker_s": meta.get("worker_s", 0.0) + time.perf_counter() - began[0],
            "worker_cpu_s": meta.get("worker_cpu_s", 0.0) + time.thread_time() - began[1]}
