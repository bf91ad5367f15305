"""Decoding sequences' contexts kept contiguous from step to step, for the plain-torch attention.

The torch decode kernel gathers every sequence's context out of the paged pool into a padded grid,
in every layer of every step; on a CPU that copy costs about as much as the attention over it
(``python -m bench.bench_vllm_attention``). ``ContextGrids`` keeps one such grid of keys and one
of values per layer, ``(rows, capacity, Hkv, D)``, across steps. Position ``p`` of row ``r``
mirrors pool slot ``slots[r, p]`` (-1: none); ``where`` is the inverse, slot -> ``r * capacity + p``.

The grids hold what the pool holds, because:

- every store of every step is copied to the grid position of each mirrored slot it writes
  (``write_through``, called right after ``kernels.store_kv``), whichever sequence owns the slot;
- anything else that writes the pool (a KV hand-off received) says which slots with
  ``pool_written``, and the next step forgets them.

A decode step (``plan``) keeps a sequence's row when the row mirrors exactly the slots of its
context before this step: only this step's token is new there, and its store writes it through.
Other sequences take free rows, gathered from the pool once, in each layer (``attend``). Attention
then runs over the grid's first rows, each query at its sequence's row; rows of no sequence in the
step attend to their position 0 and are dropped. A step whose sequences share a slot (blocks
shared between sequences), or whose grids would pass the memory budget, is not planned: it runs the
gathering kernel. Bookkeeping is host numpy, O(B x context) per step; nothing in a layer reads
device data back. The step runner keeps contexts for float32 pools on a CPU whose kernels are the
plain-torch ones: where the C++ decode kernel builds (``kernels.native``) it reads the pool in place
and no contexts are kept (``runner.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from hetserve.runtime.kernels import torch_impl

ROW_ALIGN, POSITION_ALIGN = 16, 64  # grids grow to multiples of these, with a quarter's headroom


@dataclass
class GridStep:
    """Where one decode step's sequences sit in the grids."""

    rows: torch.Tensor  # (B,) int64 grid row of each sequence (the step's first B rows; the rest pad)
    fill_rows: torch.Tensor  # (F,) int64 rows to gather from the pool in each layer
    fill_slots: torch.Tensor  # (F * fill_width,) int64 their slots, position by position
    fill_width: int
    used: int  # attention reads rows [0, used)
    width: int  # and positions [0, width): the longest context
    mask: torch.Tensor  # (used, 1, 1, width) bool


class ContextGrids:
    def __init__(self, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, budget_bytes: int):
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        k0 = kv_layers[0][0]  # (S, Hkv, D)
        self.num_slots, self.heads, self.head_dim = k0.shape
        self.dtype, self.device = k0.dtype, k0.device
        self.where = np.full(self.num_slots, -1, dtype=np.int64)  # slot -> flat grid position
        self.slots = np.full((0, 0), -1, dtype=np.int64)  # (rows, capacity) mirrored slot
        self.grids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer's k data_ptr -> (keys, values)
        self.step: GridStep | None = None
        self._where_t = torch.from_numpy(self.where)  # the same memory, for write_through's lookups
        self._written: deque[np.ndarray | None] = deque()  # slots written outside a step (None: any)

    # ------------------------------------------------------------------ called by the worker
    def pool_written(self, slots: torch.Tensor | None = None) -> None:
        """``slots`` (None: any) of the pool were written outside a step. Any thread may call this:
        the next ``plan`` forgets them, and no sequence of a step reads a slot being written then
        (a request joins a batch only once its hand-off is acknowledged)."""
        self._written.append(None if slots is None else slots.detach().cpu().numpy().astype(np.int64))

    # ------------------------------------------------------------------ once per step
    def plan(self, block_tables: np.ndarray, context_lens: np.ndarray, bucket: int) -> GridStep | None:
        """Rows for a decode step of ``B`` sequences (``block_tables (B, NB)``, ``context_lens (B,)``
        with this step's token), padded to ``bucket`` rows; None: the step gathers as usual."""
        self.step = None
        ctx = context_lens.astype(np.int64)
        width = int(ctx.max())
        pos = np.arange(width)
        wanted = np.where(pos[None, :] < ctx[:, None],
                          block_tables[:, np.minimum(pos // self.block_size, block_tables.shape[1] - 1)]
                          * self.block_size + pos % self.block_size, -1)  # (B, width)
        used = np.sort(block_tables[np.arange(block_tables.shape[1])[None, :] < -(-ctx[:, None] // self.block_size)])
        if (used[1:] == used[:-1]).any():
            return None  # a block read by two sequences: a row cannot mirror what another mirrors
        if not self._fit(bucket, width):
            return None
        while self._written:
            self._forget(self._written.popleft())
        rows, fill = self._assign(wanted, ctx)
        self.step = self._step(rows, fill, wanted, ctx, width)
        return self.step

    def unplanned(self) -> None:
        """A step that is not a planned decode (prompts, mixed, or too wide): stores still write through."""
        self.step = None

    def _fit(self, rows: int, width: int) -> bool:
        """Grow the grids to ``rows`` x ``width`` where needed (dropping their contents), within budget."""
        have_rows, have_width = self.slots.shape
        if rows <= have_rows and width <= have_width:
            return True
        new_rows = max(have_rows, _align(rows, ROW_ALIGN))
        new_width = max(have_width, _align(width + width // 4, POSITION_ALIGN))
        per_layer = 2 * new_rows * new_width * self.heads * self.head_dim * self.dtype.itemsize
        if per_layer * len(self.kv_layers) > self.budget_bytes:
            return False
        self.grids.clear()
        for k, _ in self.kv_layers:
            # one position past the grid takes the stores of slots nobody mirrors (write_through)
            flat = (new_rows * new_width + 1, self.heads, self.head_dim)
            self.grids[k.data_ptr()] = (torch.zeros(flat, dtype=self.dtype, device=self.device),
                                        torch.zeros(flat, dtype=self.dtype, device=self.device))
        self.slots = np.full((new_rows, new_width), -1, dtype=np.int64)
        self.where[:] = -1
        return True

    def _forget(self, written: np.ndarray | None) -> None:
        if written is None:
            self.slots[:] = -1
            self.where[:] = -1
            return
        at = self.where[written]
        self.slots.flat[at[at >= 0]] = -1
        self.where[written] = -1

    def _assign(self, wanted: np.ndarray, ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(grid row of each sequence, the sequences whose rows must be gathered)."""
        cap = self.slots.shape[1]
        B, width = wanted.shape
        prev = ctx - 1  # positions in the pool before this step
        at = self.where[wanted[:, 0]]
        cand = np.where((at >= 0) & (at % cap == 0), at // cap, -1)
        pos = np.arange(width)
        before = pos[None, :] < prev[:, None]  # (B, width)
        kept = self.slots[np.maximum(cand, 0)][:, :width]
        keep = (cand >= 0) & np.all(~before | (kept == wanted), axis=1)
        rows = np.where(keep, cand, -1)
        kept_rows = np.zeros(self.slots.shape[0], dtype=bool)
        kept_rows[rows[keep]] = True
        free = np.flatnonzero(~kept_rows)
        fill = np.flatnonzero(~keep)
        rows[fill] = free[:len(fill)]
        # a kept row is re-claimed from this step's token on, a filled one whole: what they mirrored
        # there goes first
        first = np.where(keep, prev, 0)
        mine = self.slots[rows]  # (B, cap)
        gone = np.arange(cap)[None, :] >= first[:, None]
        self.where[mine[gone & (mine >= 0)]] = -1
        self.slots[rows] = np.where(gone, -1, mine)
        claim = (pos[None, :] >= first[:, None]) & (pos[None, :] < ctx[:, None])
        b_idx, p_idx = np.nonzero(claim)
        new = wanted[b_idx, p_idx]
        taken = self.where[new]
        old = taken[taken >= 0]
        self.slots.flat[old] = -1  # mirrored by a row of a finished sequence: that copy goes
        flat = rows[b_idx] * cap + p_idx
        self.slots.flat[flat] = new
        self.where[new] = flat
        return rows, fill

    def _step(self, rows: np.ndarray, fill: np.ndarray, wanted: np.ndarray, ctx: np.ndarray,
              width: int) -> GridStep:
        used = int(rows.max()) + 1
        fill_width = int(ctx[fill].max()) if len(fill) else 0
        fill_slots = np.where(wanted[fill, :fill_width] >= 0, wanted[fill, :fill_width], wanted[fill, :1])
        lens = np.zeros(used, dtype=np.int64)
        lens[rows] = ctx
        mask = (np.arange(width)[None, :] < np.maximum(lens, 1)[:, None])  # other rows: their position 0
        dev = self.device
        return GridStep(rows=torch.from_numpy(rows).to(dev),
                        fill_rows=torch.from_numpy(rows[fill]).to(dev),
                        fill_slots=torch.from_numpy(np.ascontiguousarray(fill_slots).reshape(-1)).to(dev),
                        fill_width=fill_width, used=used, width=width,
                        mask=torch.from_numpy(mask).to(dev)[:, None, None, :])

    # ------------------------------------------------------------------ in each layer
    def write_through(self, k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """Copy a store into the grid positions that mirror its slots (``k_cache``: the layer's pool).
        No host read: rows of slots nobody mirrors (or -1) go to the position past the grid."""
        grids = self.grids.get(k_cache.data_ptr())
        if grids is None:
            return
        slots = slot_mapping.long()
        at = self._where_t[slots.clamp(min=0)]
        at = torch.where((slots >= 0) & (at >= 0), at, grids[0].shape[0] - 1)
        for flat, new in zip(grids, (k, v)):
            flat.index_copy_(0, at, new.to(flat.dtype))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """This layer's decode attention over its grids, after its store: q (bucket, Hq, D) -> same,
        zeros in the padding rows."""
        step = self.step
        rows, cap = self.slots.shape
        keys, values = (flat[:-1].view(rows, cap, self.heads, self.head_dim)
                        for flat in self.grids[k_cache.data_ptr()])
        if len(step.fill_rows):
            for grid, cache in ((keys, k_cache), (values, v_cache)):
                gathered = cache.view(cache.shape[0], -1).index_select(0, step.fill_slots)
                grid[step.fill_rows, :step.fill_width] = gathered.view(len(step.fill_rows), step.fill_width,
                                                                       self.heads, self.head_dim)
        B = len(step.rows)
        Hq, D = q.shape[1:]
        grouped = q.new_zeros(step.used, Hq, D)
        grouped[step.rows] = q[:B]
        grouped = grouped.view(step.used, self.heads, Hq // self.heads, D).transpose(1, 2)  # (R, G, Hkv, D)
        out = torch_impl.grid_attention(grouped, keys[:step.used, :step.width], values[:step.used, :step.width],
                                        step.mask, scale)  # (R, G, Hkv, D)
        result = torch.zeros_like(q)
        result[:B] = out.transpose(1, 2).reshape(step.used, Hq, D)[step.rows]
        return result


def _align(n: int, to: int) -> int:
    return -(-n // to) * to
