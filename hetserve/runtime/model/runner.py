"""Runs a stage's forward for one step: decode steps through static buffers, as CUDA graphs on a GPU.

A decode step (every sequence one new token) of ``B`` sequences is padded to the smallest bucket
``>= B`` (``buckets``: 1, 2, 4, 8, then multiples of 16, as nano-vllm), its padding rows writing
no KV (slot -1) and attending to nothing (context 0). Its input hidden rows, positions, slots,
block tables and context lengths are copied into buffers sized for the largest bucket, so every
step of a bucket reads the same addresses: on CUDA each bucket's forward is captured once as a
``torch.cuda.CUDAGraph`` (warm-up on a side stream, one memory pool shared by every bucket) and
replayed, one launch instead of a few dozen per layer. On CPU, or where a graph cannot be captured,
the same buffers and padding run eagerly, so the padding path is what CI tests.

A worker captures every bucket at start-up (``capture_all``), before it reports ready: while a graph
is captured no other CUDA work may run in the process, on any thread, and once the worker is ready
its receiving threads install KV hand-offs and activations on the device at any time. A caller
that never calls ``capture_all`` (one thread, no receivers: ``bench/gpu/step_check.py``) gets each
bucket captured at its first step instead.

Prompt and mixed steps, and decode batches above the largest bucket or with a block table wider
than the buffers, run eagerly with metadata of their own shape.

On a CPU (the plain-torch attention kernels) in float32, decode steps read their contexts from
grids kept contiguous between steps (``ContextGrids``), at most the KV pool's bytes again; the worker
says when it writes the pool outside a step (``pool_written``).

What cannot be captured: an all-reduce of a tensor-parallel stage over gloo (CPU, or two ranks
sharing one GPU); only NCCL's can. ``graphs=False`` is the caller's way to say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hetserve.runtime import kernels
from hetserve.runtime.model.attention import (
    AttnMeta,
    AttnPart,
    HostMeta,
    build_attn_meta,
    host_meta,
    to_device,
)
from hetserve.runtime.model.context_grids import ContextGrids

log = logging.getLogger(__name__)
CAPTURE_FAILED = "CUDA graph capture failed"  # the log line's fixed start: a GPU check greps for it


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes the runner pads to: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_batch``."""
    out = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    return out if out and out[-1] == max_batch else out + [max_batch]


@dataclass
class StepInputs:
    """One step as the runner received it; ``meta`` is what the forward reads."""

    meta: AttnMeta
    num_tokens: int  # T, the real rows
    bucket: int | None  # padded decode batch (static buffers), None: an eager step of its own shape


class StepRunner:
    """``prepare`` a step's metadata once, then ``run`` the stage's layers on its hidden rows."""

    def __init__(self, model: nn.Module, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, *, max_batch: int = 256,
                 max_blocks: int = 256, graphs: bool = True, off_why: str = "not asked"):
        self.model, self.kv_layers, self.block_size = model, kv_layers, block_size
        self.device = torch.device(device)
        self.buckets = buckets(max_batch)
        self.max_blocks = max_blocks
        # graphs need a GPU, kernels that never read back to the host (Triton's), and a caller
        # whose collectives can be captured
        impl = kernels.resolve_impl(None, self.device)
        self.graphs = graphs and self.device.type == "cuda" and impl == "triton"
        if graphs and self.device.type == "cuda" and not self.graphs:
            log.warning("CUDA graphs off: the attention kernels here are %s ones (Triton is needed)", impl)
        n = self.buckets[-1]
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=self.device)  # (N, H)
        self.positions = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=self.device)  # (N, NB)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=self.device)  # one query per row
        self.last_token = torch.arange(n, dtype=torch.int32, device=self.device)
        # with the plain-torch kernels (a CPU where the C++ ones do not build), kept contexts pay in
        # float32; in half precision the gathered grid, still in cache for the attention that
        # follows, serves as well (docs/engine.md, "Kept contexts on a CPU"). The C++ kernel reads
        # the pool in place and needs neither.
        pool_bytes = sum(k.nbytes + v.nbytes for k, v in kv_layers)
        keep = impl == "torch" and self.device.type == "cpu" and dtype == torch.float32 and kv_layers
        self.grids = ContextGrids(kv_layers, block_size, pool_bytes) if keep else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        # what became of the graphs, for the worker's start-up report: "on...", or "off: <why>"
        # (a failed capture's why starts with CAPTURE_FAILED, as its log line does)
        why = "no GPU" if self.device.type != "cuda" else off_why if not graphs else f"{impl} kernels"
        self.graph_note = "on" if self.graphs else f"off: {why}"

    def pool_written(self, slots: torch.Tensor) -> None:
        """``slots`` of the KV pool were written outside a step (a hand-off received); any thread may say so."""
        if self.grids is not None:
            self.grids.pool_written(slots)

    # ------------------------------------------------------------------ metadata, once per step
    def prepare(self, starts: list[int], q_lens: list[int], block_tables: list[list[int]]) -> StepInputs:
        """The step's metadata on the device: one host->device copy."""
        T = sum(q_lens)
        bucket = self._bucket(q_lens, starts)
        if bucket is None:
            meta = build_attn_meta(starts, q_lens, block_tables, self.block_size, self.device)
            if self.grids is not None:
                self.grids.unplanned()
                meta.grids = self.grids
            return StepInputs(meta, T, None)
        pad = bucket - len(q_lens)
        hm = host_meta(starts, q_lens, block_tables, self.block_size, width=self.max_blocks)
        _, bt, ctx, _, _ = hm.parts[0]
        bt = np.concatenate((bt[:, :self.max_blocks], np.zeros((pad, self.max_blocks), dtype=bt.dtype)))
        padded = HostMeta(positions=np.concatenate((hm.positions, np.zeros(pad, dtype=np.int64))),
                          slot_mapping=np.concatenate((hm.slot_mapping, np.full(pad, -1, dtype=np.int64))),
                          last_token=np.arange(bucket),
                          parts=[(None, bt, np.concatenate((ctx, np.zeros(pad, dtype=np.int64))),
                                  np.arange(bucket + 1), 1)])
        fresh = to_device(padded, self.block_size, self.device)
        part = fresh.parts[0]
        self.positions[:bucket].copy_(fresh.positions)
        self.slots[:bucket].copy_(fresh.slot_mapping)
        self.block_tables[:bucket].copy_(part.block_tables)
        self.context_lens[:bucket].copy_(part.context_lens)
        meta = self._static_meta(bucket)
        if self.grids is not None:
            self.grids.plan(hm.parts[0][1], ctx, bucket)
            meta.grids = self.grids
        return StepInputs(meta, T, bucket)

    def _bucket(self, q_lens: list[int], starts: list[int]) -> int | None:
        """The bucket of a decode step that fits the buffers, else None (an eager step)."""
        if not q_lens or any(q != 1 for q in q_lens) or len(q_lens) > self.buckets[-1]:
            return None
        if max(starts) + 1 > self.max_blocks * self.block_size:
            return None
        return next(b for b in self.buckets if b >= len(q_lens))

    def _static_meta(self, bucket: int) -> AttnMeta:
        part = AttnPart(tokens=None, block_tables=self.block_tables[:bucket], context_lens=self.context_lens[:bucket],
                        query_start_loc=self.query_start[:bucket + 1], max_query_len=1, num_seqs=bucket)
        return AttnMeta(positions=self.positions[:bucket], slot_mapping=self.slots[:bucket],
                        last_token=self.last_token[:bucket], num_seqs=bucket, block_size=self.block_size,
                        parts=(part,))

    # ------------------------------------------------------------------ the forward
    def run(self, step: StepInputs, h: torch.Tensor) -> torch.Tensor:
        """The stage's layers on ``h`` (T, H) -> (T, H)."""
        if step.bucket is None:
            return self.model(h, self.kv_layers, step.meta)
        b, T = step.bucket, step.num_tokens
        self.hidden[:T].copy_(h)
        if not self.graphs:
            return self.model(self.hidden[:b], self.kv_layers, step.meta)[:T]
        # after ``capture_all`` every bucket is here or graphs are off: a worker never captures here
        if b not in self._graphs and not self._capture(b, step.meta):
            return self.model(self.hidden[:b], self.kv_layers, step.meta)[:T]
        self._graphs[b].replay()
        return self._outputs[b][:T]

    def capture_all(self) -> str:
        """Capture every bucket's forward now, largest first (the shared memory pool is sized once,
        by the largest), on a step of padding rows only: no KV written, no context read, and the
        kernels launch the same grids whatever the buffers hold. Returns ``graph_note``."""
        if not self.graphs:
            return self.graph_note
        for b in sorted(self.buckets, reverse=True):
            if b not in self._graphs:
                self.slots[:b].fill_(-1)
                self.context_lens[:b].zero_()
                self.positions[:b].zero_()
                self.block_tables[:b].zero_()
                if not self._capture(b, self._static_meta(b)):
                    break
        if self.graphs:
            self.graph_note = f"on: {len(self._graphs)} buckets captured"
        return self.graph_note

    def _capture(self, bucket: int, meta: AttnMeta) -> bool:
        """Capture ``bucket``'s forward (its buffers already hold a valid step). False, logged once,
        when capture fails: graphs are off from then on and the step runs eagerly."""
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self.model(self.hidden[:bucket], self.kv_layers, meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread-local: a query of another thread (NCCL's watchdog polling its events) is no
            # error; no other thread may launch CUDA work meanwhile, which ``capture_all`` ensures
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.model(self.hidden[:bucket], self.kv_layers, meta)
        except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
            self.graph_note = f"off: {CAPTURE_FAILED} at bucket {bucket} ({type(e).__name__}: {e})"
            log.warning("%s (bucket %d, %s: %s); decode steps run eagerly", CAPTURE_FAILED, bucket,
                        type(e).__name__, e)
            self.graphs = False
            self._graphs.clear()  # replays of other buckets next to eager steps: one path, not two
            self._outputs.clear()
            return False
        self._pool = self._pool or graph.pool()
        self._graphs[bucket], self._outputs[bucket] = graph, out
        return True
