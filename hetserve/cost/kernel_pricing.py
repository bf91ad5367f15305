"""The kernel cost model as the planner, simulator and runtime meet it: per stage of a cluster.

``KernelPricing`` prices a stage's layers, its LM head and its TP all-reduces from the kernel
table (``kernel_table``) for every device that is a real GPU; ``CostModel`` uses it by default and
falls back to its roofline where a stage holds a CPU worker slot (``cpu_cores``), or where the
caller passed an ``Efficiency`` (a calibration wins). Attention's score and value products (not
among the profiled operators) stay on the roofline: FLOPs at the fitted GEMM compute fraction,
KV bytes at the fitted GEMM memory fraction. As the roofline does, the slowest device of a TP
group sets the pace.

``layer_rows`` is what ``hetserve cost layer`` prints.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from hetserve.cost.collectives import AllReduceFit, nearest_fit
from hetserve.cost.kernel_table import FITTED, ROOFLINE, SOURCE_WORDS, KernelTable, default_table
from hetserve.cost.kernels import KernelParams, LayerKernel, gemm_time, layer_time, layer_times
from hetserve.cost.profiles import LayerShape
from hetserve.specs.gpus import GpuType

_MEMO_LIMIT = 200_000  # memoised layer, head and all-reduce times before the memo starts afresh (a long simulation)


class GroupPrices:
    """What the kernel prices read of one TP group's devices, worked out on its first use
    (``KernelPricing.group``). ``number`` stands for the group's size and each GPU type's peaks and
    fitted parameters (what ``layer`` and ``head`` read): equal groups on other machines (a fleet's
    copies of one replica) share their entries in the pricing's memo."""

    def __init__(self, pricing: "KernelPricing", devices: tuple[int, ...]):
        self.tp = len(devices)
        self.covered = all(pricing.params[d] is not None for d in devices)  # every device priced here
        self.number = -1
        self.rates: tuple[tuple[float, float], ...] = ()  # attention's (FLOP/s, bytes/s) per GPU type
        self.link: float | None = None  # the in-box all-reduce's slowest link (None: not priced here)
        self.fit: AllReduceFit | None = None
        self._pricing, self._memo = pricing, pricing._memo
        self._types: tuple = ()
        self._layers: tuple[LayerKernel, ...] = ()  # per GPU type in the group
        if not self.covered:
            return
        tp = self.tp
        self._types = tuple({pricing.params[d][0].name: pricing.params[d] for d in devices}.values())  # type: ignore[index]
        full = (tp, tuple((g.fp16_flops, g.mem_bandwidth, p) for g, p, _ in self._types))
        self._layers = tuple(LayerKernel(p, g.fp16_flops, g.mem_bandwidth, pricing.shape, tp) for g, p, _ in self._types)
        self.number = pricing._group_ids.setdefault(full, len(pricing._group_ids))
        self.rates = tuple((tp * g.fp16_flops * p.gemm_compute, tp * g.mem_bandwidth * p.gemm_memory)
                           for g, p, _ in self._types)
        table, devs = pricing.table, pricing.cluster.devices
        if table.allreduce and len({devs[d].machine for d in devices}) == 1 and tp > 1:
            self.link = float(min(pricing.cluster.bandwidth[d, e] for d in devices for e in devices if d != e))
            self.fit = nearest_fit(table.allreduce, tp)

    def layer(self, tokens) -> float:
        """One layer (without attention's score/value products) at ``tokens`` rows on the group's
        slowest device."""
        key = (self.number, tokens)
        v = self._memo.get(key)
        if v is None:
            v = self._pricing._remember(key, max(k.layer_s(tokens) for k in self._layers))
        return v

    def attention(self, flops, nbytes) -> float:
        """Attention's products (``flops``) and KV traffic (``nbytes``), split over the group."""
        return max(max(flops / f, nbytes / m) for f, m in self.rates)

    def head(self, rows) -> float:
        """The LM head's product for ``rows`` sequences, its vocabulary split over the group."""
        if rows <= 0:
            return 0.0
        key = ("head", self.number, rows)
        v = self._memo.get(key)
        if v is None:
            k, tp = self._pricing, self.tp
            v = k._remember(key, max(gemm_time(p, g.fp16_flops, g.mem_bandwidth, rows, k.hidden, k.vocab / tp,
                                               k.dtype_bytes) for g, p, _ in self._types))
        return v

    def allreduce(self, nbytes) -> float | None:
        """One all-reduce inside one box from the fitted curves, over the group's slowest link;
        None where the group spans boxes (the cost model's α-β over shared links prices that)."""
        fit, link = self.fit, self.link
        if fit is None or link is None:
            return None
        key = ("allreduce", self.number, link, nbytes)
        v = self._memo.get(key)
        if v is None:
            v = self._pricing._remember(key, fit.time(nbytes, link, self.tp))
        return v


class KernelPricing:
    """Kernel-table prices for the devices of one cluster and one model."""

    def __init__(self, cluster, model, table: KernelTable | None = None):
        self.table = table or default_table()
        self.cluster, self.shape, self.dtype_bytes = cluster, LayerShape.of_model(model), model.dtype_bytes
        self.hidden, self.vocab = model.hidden, model.vocab
        self.params: list[tuple[GpuType, KernelParams, str] | None] = []
        for d in cluster.devices:
            if d.cpu_cores is not None:  # a CPU worker slot: its GPU type is a price tag, not its speed
                self.params.append(None)
            else:
                p, source = self.table.params_for(d.gpu.name)
                self.params.append((d.gpu, p, source))
        self._memo: dict = {}
        self._groups: dict[tuple[int, ...], GroupPrices] = {}  # devices -> what the prices read of them
        self._group_ids: dict = {}
        # GPU types every device of which is priced here (the bound's device kinds go by type)
        by_type: dict[str, list] = {}
        for d, entry in zip(cluster.devices, self.params):
            by_type.setdefault(d.gpu.name, []).append(entry)
        self._by_type = {name: es[0] for name, es in by_type.items() if all(e is not None for e in es)}

    def roofline_rates(self, flops: list[float], membw: list[float]) -> tuple[list[float], list[float]]:
        """Per-device FLOP/s and bytes/s for the roofline that readers of ``CostModel._flops`` /
        ``_membw`` apply (the planner's upper bound, its memo keys): on priced devices the peaks at the
        fitted GEMM fractions. That roofline never prices a layer above the kernel model does (the
        kernel model adds floors, tiles and the smooth ramp on top of the same two terms), so a
        bound drawn from it stays a bound."""
        out_f, out_m = list(flops), list(membw)
        for d, entry in enumerate(self.params):
            if entry is not None:
                g, p, _ = entry
                out_f[d], out_m[d] = g.fp16_flops * p.gemm_compute, g.mem_bandwidth * p.gemm_memory
        return out_f, out_m

    def allreduce_floor(self, workers: int, nbytes, link_bandwidth: float, alpha_beta, in_box: bool = False):
        """All-reduce times of ``nbytes`` (an array or a number) for the planner's bound: inside one
        box (``in_box``) the fitted curve over ``link_bandwidth``, as ``allreduce`` charges; else
        ``alpha_beta`` (the α-β times) capped by it: a floor under either charge."""
        if not self.table.allreduce or workers <= 1:
            return alpha_beta
        fitted = nearest_fit(self.table.allreduce, workers).times(nbytes, link_bandwidth, workers)
        return fitted if in_box else np.minimum(alpha_beta, fitted)

    def covers(self, devices) -> bool:
        """Whether every device of a stage is priced here (no CPU worker slot among them)."""
        return self.group(devices).covered

    def sources(self, devices: Iterable[int] | None = None) -> dict[str, str]:
        """{GPU type: ``fitted`` / ``transferred`` / ``roofline``} over the cluster's devices, or over
        the device indices ``devices`` only."""
        out: dict[str, str] = {}
        for i in range(len(self.params)) if devices is None else devices:
            d, entry = self.cluster.devices[i], self.params[i]
            out.setdefault(d.gpu.name if entry is None else entry[0].name, ROOFLINE if entry is None else entry[2])
        return out

    def group(self, devices) -> GroupPrices:
        """What the prices read of the TP group of ``devices`` (kept per group)."""
        devices = tuple(devices)
        g = self._groups.get(devices)
        if g is None:
            g = self._groups[devices] = GroupPrices(self, devices)
        return g

    def layer(self, devices, tokens: float) -> float:
        """One layer (without attention's score/value products) at ``tokens`` rows on the slowest
        device of a TP group of ``devices``."""
        return self.group(devices).layer(tokens)

    def _remember(self, key, value: float) -> float:
        """Keep ``value`` in the memo (started afresh past ``_MEMO_LIMIT`` entries: a long simulation)."""
        if len(self._memo) > _MEMO_LIMIT:
            self._memo.clear()
        self._memo[key] = value
        return value

    def attention(self, devices, flops: float, nbytes: float) -> float:
        """Attention's products (``flops``) and KV traffic (``nbytes``), split over the group."""
        return self.group(devices).attention(flops, nbytes)

    def attention_rates(self, devices) -> tuple[tuple[float, float], ...]:
        """(FLOP/s, bytes/s) of attention's products and KV traffic on the group, per GPU type in it
        (the slowest sets the pace)."""
        return self.group(devices).rates

    def head(self, devices, rows: float) -> float:
        """The LM head's product for ``rows`` sequences, its vocabulary split over the group."""
        return self.group(devices).head(rows)

    def allreduce(self, devices, nbytes: float) -> float | None:
        """One all-reduce inside one box from the fitted curves, over the group's slowest link;
        None where the group spans boxes (the cost model's α-β over shared links prices that)."""
        return self.group(devices).allreduce(nbytes)

    # ------------------------------------------------------------------ by GPU type, over arrays
    def prices_type(self, gpu_name: str) -> bool:
        """Whether every device of this GPU type is priced here."""
        return gpu_name in self._by_type

    def layer_times(self, gpu_name: str, tp: int, tokens, attn_flops, kv_bytes) -> np.ndarray:
        """``layer`` + ``attention`` of a TP group of one GPU type, over arrays of token counts."""
        g, p, _ = self._by_type[gpu_name]
        attn = np.maximum(np.asarray(attn_flops, float) / (tp * g.fp16_flops * p.gemm_compute),
                          np.asarray(kv_bytes, float) / (tp * g.mem_bandwidth * p.gemm_memory))
        return layer_times(p, g.fp16_flops, g.mem_bandwidth, self.shape, tp, tokens) + attn

    def head_times(self, gpu_name: str, tp: int, rows) -> np.ndarray:
        """``head`` over an array of row counts."""
        g, p, _ = self._by_type[gpu_name]
        return np.vectorize(lambda r: gemm_time(p, g.fp16_flops, g.mem_bandwidth, r, self.hidden, self.vocab / tp,
                                                self.dtype_bytes) if r > 0 else 0.0, otypes=[float])(rows)


def layer_rows(gpu: GpuType, model, tps, tokens, table: KernelTable | None = None) -> tuple[list[dict], str]:
    """(rows of ``hetserve cost layer``, the source of their figures) for one GPU type and model:
    ``linear_s`` (QKV, output, gate+up, down), ``layer_s`` (the whole layer without attention's
    score/value products) and ``allreduce_s`` (one all-reduce of the layer's activations, ``tokens``
    x hidden, across the TP group on the GPU type's default in-box link) on one TP rank. Each row
    names its ``source`` and whether its token count lies outside the profiled range
    (``extrapolated``: the fit's form carried past what was measured)."""
    from hetserve.specs.cluster import GBPS, default_intra_link
    table = table or default_table()
    params, source = table.params_for(gpu.name)
    span = table.profiled_tokens(gpu.name)
    shape = LayerShape.of_model(model)
    link = default_intra_link(gpu)[0] * GBPS
    rows = []
    for tp in tps:
        for n in tokens:
            lt = layer_time(params, gpu.fp16_flops, gpu.mem_bandwidth, shape, tp, n)
            nbytes = n * model.hidden * model.dtype_bytes
            ar = table.allreduce_time(tp, nbytes, link) if table.allreduce or tp == 1 else None
            rows.append({"gpu": gpu.name, "model": model.name, "tp": tp, "tokens": n, "linear_s": lt.linear_s,
                         "layer_s": lt.layer_s, "allreduce_s": ar, "source": source,
                         "extrapolated": span is not None and not span[0] <= n <= span[1]})
    return rows, source


def describe_source(source: str) -> str:
    return SOURCE_WORDS.get(source, source)


def describe_pricing(pricing: dict[str, str]) -> str:
    """One line saying how each GPU type's times are priced (``CostModel.pricing()``)."""
    by: dict[str, list[str]] = {}
    for name, how in pricing.items():
        by.setdefault(how, []).append(name)
    return "; ".join(f"{', '.join(sorted(names))}: {describe_source(how)}" for how, names in sorted(by.items()))


__all__ = ["KernelPricing", "GroupPrices", "layer_rows", "describe_source", "describe_pricing", "FITTED"]
