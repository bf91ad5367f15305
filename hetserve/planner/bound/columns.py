"""Proven capacity ceilings of one device group (a "column" of ``planner.bound``'s programme).

For a *composition* — how many devices of each kind a group holds (a kind: one GPU type on one
machine, or all of a GPU type's devices at its best link) — and a role, ``ColumnBounds.exact`` returns
a number no layout of such a group can beat under the cost model (``cost.analytic``), whatever
its TP split, stage order or layer split. The proof, term by term:

* **Stages.** A layout is a pipeline of S stages; every stage is a TP group of ``t`` devices of
  one kind (the planners' search space: ``LayoutSearch`` builds TP groups inside one class) with
  ``t`` in the model's allowed degrees. We enumerate every multiset of such stages that uses all
  the group's devices exactly (each kind's count cut into allowed degrees); a layout that leaves
  devices idle is a layout of the smaller composition it uses, and the programme counts such a
  group as that composition (its idle devices only loosen the device rows). Stage order only
  changes hand-offs and where embeddings / head sit: hand-offs are charged at the fewest machine
  changes (below) and the embeddings / head weights only in total.
* **Hand-offs**: a pipeline through r machines crosses between machines at least r − 1 times,
  each a ``p2p_time`` of at least the smallest α and the largest β between those machines.
* **Per-layer times** are the cost model's own formulas for a one-kind stage — roofline
  ``max(FLOPs / (t·f), bytes / (t·B))`` plus two all-reduces per layer, each
  ``2·(t−1)·(α + bytes/(t·β))`` (inside one class every pair has the same link, so this is
  ``CostModel.allreduce_time`` exactly), plus the collective and step overheads. Only the
  layer count ``l_i`` of each stage is free; every time below is linear in it. A calibration's
  per-byte terms (``Efficiency.multi_row_s_per_byte``, ``collective_s_per_byte``) and a prompt
  step's own fixed cost (``prompt_step_overhead_s``) are left out: they only add time, so the
  ceiling still holds, less tightly.
* **Layer split relaxed to reals**, ``0 ≤ l_i ≤ cap_i`` and ``Σ l_i = L``: the real split is one
  of these points, so the minimum of a time over them is a lower bound on the layout's time.
  ``cap_i`` is the memory rule of ``CostModel.stage_kv_capacity`` solved for ``l``: a stage of
  ``t`` devices with usable memory ``M`` holding ``l`` layers and ``x`` KV tokens needs
  ``l·(P·dtype + x·kv_l) ≤ t·(M − activations)`` (its leader's embeddings / head only make it
  tighter; they are charged in total: ``Σ_i t_i·(M_i − act) − E ≥ L·(P·dtype + x·kv_l)``).
* **Prefill** (one prompt at a time, no micro-batching): TTFT ≥ min Σ_i l_i·τ_i + Σ_i e_i
  + the smallest head time — a fractional knapsack (fill the fastest stages to their memory cap);
  capacity ≤ T / that.
* **Decode** at every batch ``b`` up to the engine cap (the real one is the largest that fits,
  one of them): ``m = min(S, b)`` micro-batches of ``b/m``; the cost model's step is
  ``max(Σ stage + hops, m·max stage)``, so step ≥ max(min Σ_i T_i, min m·max_i T_i): the
  knapsack and a water-filling level; KV memory caps ``l_i`` at ``x = b·(I + O)`` tokens (this is
  what makes small groups slow: little memory after the weights, a small batch). Capacity ≤
  T·b / (O·step), maximised over ``b``.
* **Colocated**: the cost model's steady state mixes ``k`` prompts into a share ``s`` of the steps;
  the mean step ``s·max(prefill of the mixed batch, decode) + (1−s)·decode`` is at least both
  ``s·prefill + (1−s)·Σ decode stages`` (one knapsack, the prefill pass is not micro-batched)
  and the decode step's bound; capacity ≤ T·(b/O) / that, maximised over ``b``.

**Groups larger than the column cap K** (``big``): a group using more than K devices has more
than K ≥ the largest TP degree devices in use, so S ≥ 2 stages and ``m ≥ min(2, b)``:

* prefill / colocated: the prompt passes every stage in turn, so its time is at least L × the
  per-layer time of the group's fastest stage type (kind g, degree t; memory ignored): a ceiling
  *per group* for each stage type, such a group holding t devices of kind g and K + 1 in all;
  colocated also at most the decode rates below (its mean step is at least the decode step);
* decode: ``step ≥ m·T_i`` for every stage gives ``l_i ≤ step / ρ_i`` with ``ρ_i = m·τ_i(b/m)``,
  and Σ l_i = L, so capacity ≤ T·b/(O·L)·Σ_i 1/ρ_i — a rate per device (``1 / (t·ρ)``, at the
  best TP degree and batch), valid for any such group; ``big_decode`` gives it per stage kind at
  the group's own stage count S (m = min(S, b)), for ``big_rows``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from hetserve.planner.bound.layer_split import knapsack, waterfill

ROLES = ("prefill", "decode", "colocated")
BIG_STAGES = 8  # big decode groups are told apart by their stage count 2 … 7, then "8 or more"
STRUCTURE_CHUNK = 64  # structures priced at once: 64 × 256 batch sizes × 2S × S floats at most 16 MB


@dataclass(frozen=True)
class Kind:
    """One device kind of the columns: per-device figures of the cost model and the link
    between two devices of the kind (α s, β bytes/s) that a TP group of them uses."""

    name: str
    count: int
    flops: float
    membw: float
    usable: float
    alpha: float
    beta: float
    machine: str
    device: int = -1  # a device of the kind (for the links to other machines); -1: kinds span machines
    gpu: str = ""  # its GPU type: the cost model's kernel prices where it has them (``cost.kernel_pricing``)


class ColumnBounds:
    """Capacity ceilings (requests per T) of compositions over ``kinds`` for one ``PlanContext``."""

    def __init__(self, ctx, kinds: list[Kind]):
        self.ctx, self.kinds = ctx, kinds
        m, eff = ctx.model, ctx.cost.eff
        self.T, self.L = ctx.period_s, m.num_layers
        self.I = max(1, round(ctx.input_tokens))
        self.Ir, self.O = ctx.input_tokens, ctx.output_tokens
        self.Oc = max(self.O, 1.0)
        self.tp_ok = [t for t in ctx.layouts.tp_ok]
        self.act = eff.activation_buffers * eff.activation_tokens * m.hidden * m.dtype_bytes
        self.extras = (m.embedding_params + m.head_params + (m.vocab * m.hidden if m.tie_embeddings else 0)) * m.dtype_bytes
        self.b = np.arange(1, eff.max_batch + 1, dtype=float)
        self._cache: dict[tuple, tuple[float, float, float]] = {}
        self._stage_cache: dict[tuple[int, int], dict] = {}
        self._dl_cache: dict[tuple[int, int, float], np.ndarray] = {}

    # ------------------------------------------------------------------ one stage kind
    def _per_layer(self, k: Kind, t: int, tokens, sum_sq, ctx_tokens):
        """Per-layer seconds of a ``t``-device stage of kind ``k``: roofline + 2 all-reduces of
        ``tokens`` activations + the per-layer collective overheads (``CostModel.stage_*_time``)."""
        m, eff = self.ctx.model, self.ctx.cost.eff
        roof = self._layer(k, t, tokens, 2.0 * m.q_dim * sum_sq, ctx_tokens)
        if t <= 1:
            return roof
        ar = self._allreduce(t, k, tokens)
        return roof + 2.0 * ar + 2.0 * eff.collective_overhead_s

    def _allreduce(self, t: int, k: Kind, rows):
        """One all-reduce of ``rows`` tokens of activations: the α-β model, or the kernel model's
        fitted in-box curve where the cost model prices with it. A kind spanning machines too: the
        bound's TP groups are inside one machine (its scope), where the cost model charges that
        curve over the group's slowest link, and the curve only falls as the link gets faster, so
        at the kind's best link (``beta``) it is a floor for every machine of the kind."""
        m, kern = self.ctx.model, self._kernels(k)
        ar = 2.0 * (t - 1) * (k.alpha + rows * m.hidden * m.dtype_bytes / t / k.beta)
        return ar if kern is None else kern.allreduce_floor(t, rows * m.hidden * m.dtype_bytes, k.beta, ar,
                                                            in_box=True)

    def _kernels(self, k: Kind):
        kern = self.ctx.cost.kernels
        return kern if kern is not None and kern.prices_type(k.gpu) else None

    def _layer(self, k: Kind, t: int, tokens, attn_flops, kv_tokens):
        """One layer's compute as the cost model prices it: the kernel model where it prices the
        kind's GPU type, else the roofline."""
        m, kern = self.ctx.model, self._kernels(k)
        kv = kv_tokens * m.kv_bytes_per_token_per_layer
        if kern is not None:
            return kern.layer_times(k.gpu, t, tokens, attn_flops, kv)
        flops = 2.0 * m.params_per_layer * tokens + attn_flops
        return np.maximum(flops / (t * k.flops), (m.bytes_per_layer + kv) / (t * k.membw))

    def _fixed(self, t: int) -> float:
        eff = self.ctx.cost.eff
        return eff.step_overhead_s + (3 * eff.collective_overhead_s if t > 1 else 0.0)

    def _head(self, k: Kind, t: int, rows):
        m, eff = self.ctx.model, self.ctx.cost.eff
        kern = self._kernels(k)
        roof = (kern.head_times(k.gpu, t, rows) if kern is not None else
                np.maximum(2.0 * m.hidden * m.vocab * rows / (t * k.flops), m.vocab * m.hidden * m.dtype_bytes / (t * k.membw)))
        return roof + eff.iteration_overhead_s + eff.seq_overhead_s * rows

    def _stage(self, ki: int, t: int) -> dict:
        """Vectors over the batch b = 1…cap of one stage kind's per-layer times and memory."""
        key = (ki, t)
        if key in self._stage_cache:
            return self._stage_cache[key]
        k, b = self.kinds[ki], self.b
        I, Ir, O = self.I, self.Ir, self.O
        cbar = Ir + O / 2
        out = {"room": t * (k.usable - self.act)}  # bytes for weights + KV over the stage
        out["pf"] = float(self._per_layer(k, t, I, float(I) * I, I))
        out["pf_head"] = float(self._head(k, t, 1))
        joins = b / self.Oc
        share = -np.expm1(-joins)
        kk = joins / share
        nseq = np.maximum(1, np.round(kk))
        # the mixed step as the cost model prices it: one prefill batch of decode + prompt tokens
        tok = b + kk * Ir
        out["mix"] = self._per_layer(k, t, tok, 2.0 * b * cbar + kk * Ir * Ir, tok)
        out["mix_head"] = self._head(k, t, b + nseq)
        self._stage_cache[key] = out
        return out

    def _dl(self, ki, t, micro):
        """Per-layer seconds of a decode step of a ``t``-device stage of kind ``ki`` at every batch
        b, split into ``micro`` micro-batches (b / min(micro, b) sequences each, at the mean
        context), cached: every structure with as many stages asks for the same vector. Read-only."""
        key = (ki, t, float(micro))
        out = self._dl_cache.get(key)
        if out is None:
            out = self._dl_rows(ki, t, [micro])[0]
            out.flags.writeable = False
            self._dl_cache[key] = out
        return out

    def _dl_rows(self, ki, t, micros) -> np.ndarray:
        """``_dl`` for each of ``micros`` at once (a row each; the same numbers, element by element)."""
        k, m = self.kinds[ki], self.ctx.model
        mb = (self.b[None, :] / np.minimum(np.asarray(micros, dtype=float)[:, None], self.b[None, :])).ravel()
        cbar = self.Ir + self.O / 2
        out = self._layer(k, t, mb, 4.0 * m.q_dim * mb * cbar, mb * cbar)
        if t > 1:
            out = out + 2.0 * self._allreduce(t, k, mb) + 2.0 * self.ctx.cost.eff.collective_overhead_s
        return out.reshape(len(micros), len(self.b))

    # ------------------------------------------------------------------ one structure
    def _hops(self, kinds: list[int]) -> tuple[int, float, float]:
        """(hand-offs between machines at least, the smallest α and the largest β among them):
        a pipeline through r machines crosses between machines at least r − 1 times."""
        devs = {self.kinds[k].machine: self.kinds[k].device for k in kinds}
        if len(devs) < 2 or min(devs.values()) < 0:
            return 0, 0.0, 1.0
        lat, bw = self.ctx.cluster.latency, self.ctx.cluster.bandwidth
        reps = list(devs.values())
        pairs = [(a, b) for a in reps for b in reps if a != b]
        return len(reps) - 1, min(float(lat[a, b]) for a, b in pairs), max(float(bw[a, b]) for a, b in pairs)

    def _structures(self, batch: list[tuple[tuple[tuple[int, int], ...], tuple[int, float, float]]]) -> np.ndarray:
        """Ceilings (prefill, decode, colocated), a row each, of layouts made of exactly the given
        stages whose pipeline crosses between machines at least ``hops[0]`` times (α ≥ hops[1],
        β ≤ hops[2]). Every (stages, hops) of ``batch`` has the same stage count S, so each step
        below runs once over all of them (rows: structure × batch size), the same numbers as one
        at a time."""
        m = self.ctx.model
        L, T, b, S, nb = self.L, self.T, self.b, len(batch[0][0]), len(self.b)
        W, kvl = m.params_per_layer * m.dtype_bytes, m.kv_bytes_per_token_per_layer
        out = np.zeros((len(batch), 3))
        info = [[self._stage(ki, t) for ki, t in stages] for stages, _ in batch]
        room = np.array([[s["room"] for s in row] for row in info]).reshape(len(batch), S)
        free = np.array([r.sum() for r in room]) - self.extras  # memory past embeddings / head
        if not len(keep := np.nonzero(free >= L * W)[0]):
            return out
        n, room, free, info = len(keep), room[keep], free[keep], [info[i] for i in keep]
        nh, alpha, beta = (np.array([batch[i][1][j] for i in keep], dtype=float)[:, None] for j in range(3))
        act_bytes = m.hidden * m.dtype_bytes

        def hop(tokens):  # hand-offs of ``tokens`` activations: p2p_time, α + bytes / β each
            return nh * (alpha + tokens * act_bytes / beta)

        fixed = np.array([[self._fixed(t) for _, t in batch[i][0]] for i in keep])
        fixed_sum = np.array([f.sum() for f in fixed])[:, None]
        # prefill: weights only (one token of KV, as ``fits``)
        pf = np.array([[s["pf"] for s in row] for row in info])
        head = np.array([min(s["pf_head"] for s in row) for row in info])[:, None]
        ttft = (knapsack(pf, room / (W + kvl), L)[:, None] + fixed_sum + head + hop(self.I))[:, 0]
        with np.errstate(divide="ignore"):
            out[keep, 0] = np.where(np.isfinite(ttft), T / ttft, 0.0)
        # decode / colocated at every batch b: memory caps on layers
        den = W + b * (self.Ir + self.O) * kvl  # (nb,)
        cap = (room[:, None, :] / den[None, :, None]).reshape(n * nb, S)
        ok = free[:, None] / den[None, :] >= L
        mb = b / (mcount := np.minimum(S, b))  # micro-batch
        dec = np.stack([np.stack([self._dl(ki, t, S) for ki, t in batch[i][0]], axis=1) for i in keep]).reshape(n * nb, S)
        rows = lambda x: x.reshape(n, nb)  # noqa: E731
        e = np.broadcast_to(fixed[:, None, :], (n, nb, S)).reshape(n * nb, S)
        step = np.maximum(rows(knapsack(dec, cap, L)) + fixed_sum + hop(mb), mcount * rows(waterfill(dec, e, cap, L)))
        with np.errstate(divide="ignore", invalid="ignore"):
            out[keep, 1] = np.where(ok & np.isfinite(step), T * b / (self.Oc * step), 0.0).max(axis=1, initial=0.0)
        share = -np.expm1(-(joins := b / self.Oc))
        mix = np.stack([np.stack([s["mix"] for s in row], axis=1) for row in info]).reshape(n * nb, S)
        mix_head = np.stack([np.min(np.stack([s["mix_head"] for s in row], axis=1), axis=1) for row in info])
        sh = np.repeat(share[None, :], n, axis=0).reshape(n * nb, 1)
        lin = (rows(knapsack(sh * mix + (1 - sh) * dec, cap, L)) + fixed_sum + share * mix_head
               + share * hop(b + joins / share * self.Ir) + (1 - share) * hop(mb))
        with np.errstate(divide="ignore", invalid="ignore"):
            avg = np.maximum(lin, step)
            out[keep, 2] = np.where(ok & np.isfinite(avg), T * joins / avg, 0.0).max(axis=1, initial=0.0)
        return out

    # ------------------------------------------------------------------ groups beyond K
    def big(self) -> tuple[list[tuple[int, int]], list[float], list[float], list[float]]:
        """For groups using more devices than any TP group holds (so S ≥ 2 stages): the stage
        kinds (kind, t), per stage kind the prefill ceiling of one group whose fastest stage is
        of it and the colocated ceiling of one whose best stage is of it, and per kind the decode
        rate of one device."""
        L, T, b = self.L, self.T, self.b
        joins = b / self.Oc
        share = -np.expm1(-joins)
        mcount = np.minimum(2, b)
        stages = [(ki, t) for ki, k in enumerate(self.kinds) for t in self.tp_ok if t <= k.count]
        prefill, colocated, rates = [], [], []
        for ki, t in stages:
            prefill.append(T / (L * self._stage(ki, t)["pf"]))
            mix = share * self._stage(ki, t)["mix"] + (1 - share) * self._dl(ki, t, 2)
            colocated.append(float((T * joins / (L * mix)).max()))
        for ki, k in enumerate(self.kinds):
            best = 0.0
            for t in (t for t in self.tp_ok if t <= k.count):
                rho = mcount * self._dl(ki, t, 2)  # seconds per layer per step
                best = max(best, float((T * b / (self.Oc * L * t * rho)).max()))
            rates.append(best)
        return stages, prefill, colocated, rates

    def big_decode(self, stages: list[tuple[int, int]]) -> np.ndarray:
        """Per stage kind (kind, t) and stage count S = 2 … ``BIG_STAGES`` of a big decode group
        (the last: that many or more), the decode rate of one device of such a stage: capacity ≤
        T·b/(O·L)·Σ_i 1/ρ_i with ``ρ_i = m·τ_i(b/m)``, ``m = min(S, b)`` (``big``'s rule at the
        group's own S rather than at the fewest, 2), maximised over b per stage — the sum of
        those maxima is at least the group's at its one b. The last bucket takes the largest
        over every m from ``BIG_STAGES`` up."""
        L, T, b = self.L, self.T, self.b
        out = np.zeros((len(stages), BIG_STAGES - 1))
        ms = np.arange(2, max(int(b[-1]), BIG_STAGES) + 1, dtype=float)[:, None]  # past the largest batch, m = b
        for i, (ki, t) in enumerate(stages):
            per_m = (T * b / (self.Oc * L * t * np.minimum(ms, b) * self._dl_rows(ki, t, ms[:, 0]))).max(axis=1)
            out[i, :-1] = per_m[:BIG_STAGES - 2]
            out[i, -1] = per_m[BIG_STAGES - 2:].max()
        return out

    # ------------------------------------------------------------------ compositions
    def _splits(self, n: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []

        def rec(rest, top, acc):
            if rest == 0:
                out.append(acc)
                return
            for t in self.tp_ok:
                if t <= min(rest, top):
                    rec(rest - t, t, acc + (t,))

        rec(n, n, ())
        return out

    def exact(self, comp: tuple[int, ...]) -> tuple[float, float, float]:
        """Ceilings of layouts that use every device of ``comp`` (counts per kind)."""
        hit = self._cache.get(comp)
        return hit if hit is not None else self.exact_many([comp])[0]

    def exact_many(self, comps: list[tuple[int, ...]]) -> list[tuple[float, float, float]]:
        """``exact`` of each composition: the structures of all of them priced together, those of
        one stage count at a time (``_structures``), in chunks of ``STRUCTURE_CHUNK``."""
        todo = [c for c in dict.fromkeys(comps) if c not in self._cache]
        by_stages: dict[int, list] = {}
        for c in todo:
            per_kind = [[(ki, s) for s in self._splits(n)] for ki, n in enumerate(c) if n]
            hops = self._hops([ki for ki, n in enumerate(c) if n])
            for combo in itertools.product(*per_kind):
                stages = tuple((ki, t) for ki, split in combo for t in split)
                if stages:
                    by_stages.setdefault(len(stages), []).append((c, stages, hops))
        best = {c: np.zeros(3) for c in todo}
        for items in by_stages.values():
            for i in range(0, len(items), STRUCTURE_CHUNK):
                chunk = items[i:i + STRUCTURE_CHUNK]
                for (c, _, _), vals in zip(chunk, self._structures([(st, h) for _, st, h in chunk])):
                    best[c] = np.maximum(best[c], vals)
        self._cache.update((c, tuple(float(v) for v in best[c])) for c in todo)
        return [self._cache[c] for c in comps]

    def relaxed(self, comp: tuple[int, ...]) -> tuple[float, float, float]:
        """Ceilings of layouts that use every device of ``comp`` without enumerating their
        stages (for groups past K devices): each kind's devices hold at most their memory's
        layers; a Σ-over-stages time is at least each kind's fastest TP degree per layer at the
        smallest micro-batch (b over Σ devices micro-batches), the max-stage time at least the
        fewest device-seconds per layer spread over the kind's devices with m = min(2, b) (at
        least two stages: more than K ≥ any TP degree devices), the stage overheads at least
        one step overhead per stage for the fewest stages; hand-offs as ``exact``."""
        key = ("relaxed", comp)
        if key in self._cache:
            return self._cache[key]
        m, eff = self.ctx.model, self.ctx.cost.eff
        L, T, b = self.L, self.T, self.b
        kinds = [ki for ki, n in enumerate(comp) if n]
        tps = {ki: [t for t in self.tp_ok if t <= comp[ki]] for ki in kinds}
        n_dev = float(sum(comp))
        S_min = max(2.0, float(sum(math.ceil(comp[ki] / max(tps[ki])) for ki in kinds)))
        fixed, e_min = S_min * eff.step_overhead_s, eff.step_overhead_s
        nh, alpha, beta = self._hops(kinds)
        act_bytes = m.hidden * m.dtype_bytes

        def hop(tokens):
            return nh * (alpha + tokens * act_bytes / beta)

        room = np.array([comp[ki] * (self.kinds[ki].usable - self.act) for ki in kinds])
        W, kvl = m.params_per_layer * m.dtype_bytes, m.kv_bytes_per_token_per_layer
        if room.sum() - self.extras < L * W:
            self._cache[key] = (0.0, 0.0, 0.0)
            return self._cache[key]
        info = {(ki, t): self._stage(ki, t) for ki in kinds for t in tps[ki]}
        pf = np.array([min(info[(ki, t)]["pf"] for t in tps[ki]) for ki in kinds])
        ttft = (knapsack(pf[None, :], (room / (W + kvl))[None, :], L)[0] + fixed
                + min(v["pf_head"] for v in info.values()) + hop(self.I))
        prefill = T / ttft if math.isfinite(ttft) else 0.0
        den = W + b * (self.Ir + self.O) * kvl
        cap = room[None, :] / den[:, None]
        ok = (room.sum() - self.extras) / den >= L
        mb = b / np.minimum(n_dev, b)
        m2 = np.minimum(2.0, b)
        dec = np.stack([np.min([self._dl(ki, t, n_dev) for t in tps[ki]], axis=0) for ki in kinds], axis=1)
        per_dev = np.stack([np.min([t * m2 * self._dl(ki, t, 2) for t in tps[ki]], axis=0) / comp[ki]
                            for ki in kinds], axis=1)
        step = np.maximum(knapsack(dec, cap, L) + fixed + hop(mb),
                          waterfill(per_dev, np.full_like(per_dev, e_min), cap, L))
        with np.errstate(divide="ignore", invalid="ignore"):
            decode = float(np.where(ok & np.isfinite(step), T * b / (self.Oc * step), 0.0).max(initial=0.0))
        share = -np.expm1(-(joins := b / self.Oc))
        mix = np.stack([np.min([share * info[(ki, t)]["mix"] + (1 - share) * self._dl(ki, t, n_dev)
                                for t in tps[ki]], axis=0) for ki in kinds], axis=1)
        mix_head = np.min(np.stack([v["mix_head"] for v in info.values()], axis=1), axis=1)
        lin = (knapsack(mix, cap, L) + fixed + share * mix_head + share * hop(b + joins / share * self.Ir)
               + (1 - share) * hop(mb))
        avg = np.maximum(lin, step)
        with np.errstate(divide="ignore", invalid="ignore"):
            colocated = float(np.where(ok & np.isfinite(avg), T * joins / avg, 0.0).max(initial=0.0))
        self._cache[key] = (prefill, decode, colocated)
        return self._cache[key]
