"""Capacities that count only requests meeting the SLOs (the ``goodput`` and ``cost`` objectives).

A replica's throughput capacity (``CostModel.*_capacity``) runs it flat out: prompts queue, the
decode batch is as large as memory and the engine allow. Under a TTFT / TPOT target the useful
capacity is smaller:

* **decode**: the largest batch whose step time (= TPOT) stays within ``tpot_s``; capacity is
  that batch's tokens/s, in requests per T. No batch meets it: 0.
* **prefill**: the unloaded TTFT must meet ``ttft_s``; with requests arriving at random (Poisson)
  and served one at a time (deterministic service s = TTFT), the mean time in system of an
  M/D/1 queue is s + ρ·s / (2(1 − ρ)); the load ρ is capped where that reaches ``ttft_s``:
  ρ ≤ 2(S − s) / (2S − s), S = ``ttft_s``. (A mean, not a percentile: a planning estimate.)
* **colocated**: the decode batch within ``COLOCATED_TPOT_SHARE`` × ``tpot_s`` (prompts that
  arrive stall the running batch, and the stalls land on the TPOT: in the simulator a colocated
  plan whose batch met the TPOT exactly missed it at p90), then the same TTFT load cap with the
  request's own prefill as the service.

Decode and colocated capacities are at most the replica's throughput capacity (goodput ≤
throughput: a request served within the SLOs is a request served). Not a formality for colocated
replicas: the formula above prices a prompt as a stand-alone TTFT, the throughput capacity as a
prompt riding in a decode step (``CostModel.colocated_capacity``), and on layouts of a
4×H100 + 2×A100 pool (Llama-2-13B and -70B; Azure trace and its LPHD class) the first came out
up to 4.7 % higher. ``planner.bound`` bounds
goodput by the group bound without SLOs, which holds because of this cap.

* **KV hand-offs on shared links** (NICs, site pipes, dedicated links: the flow network's
  capacity nodes): a hand-off keeps the prompt's KV on its prefill replica until it has crossed,
  so hand-offs that queue on a busy link hold prefill memory, the prefills stall and the TTFT
  grows (in the simulator a plan whose pipes were planned full met the SLOs for 43 % of its
  fastest prefill replica's prompts, TTFT p90 14 s). Links are shared max-min fairly
  (``cost.network``), on one link processor sharing, whose mean time in system for a transfer
  of s seconds alone is s / (1 − ρ) whatever else loads it. ``link_load_cap`` caps the load
  where that reaches the TTFT target, s = the bytes the route's KV puts on the link over its
  bandwidth; ``kv_loads_within`` charges the route's bytes there as bytes / cap, so a link that
  carries only this route's KV fills to that cap, and PP / TP traffic alone is not capped. A
  route whose KV alone takes the TTFT on some link carries nothing.

Estimates, with the cost model's assumed efficiencies; the simulator measures the real attainment.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve.cost.layout import ReplicaLayout
from hetserve.specs.network import Resource

COLOCATED_TPOT_SHARE = 0.75  # of the TPOT target left to decode steps on a colocated replica


@dataclass(frozen=True)
class SLOTargets:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for k in ("ttft_s", "tpot_s"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ValueError(f"SLO {k} must be positive, got {v}")

    @property
    def any(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def ttft_load_cap(service_s: float, ttft_s: float | None) -> float:
    """Largest load ρ ∈ [0, 1] at which an M/D/1 queue's mean time in system stays ≤ ``ttft_s``."""
    if ttft_s is None:
        return 1.0
    if service_s >= ttft_s:
        return 0.0
    return min(1.0, 2.0 * (ttft_s - service_s) / (2.0 * ttft_s - service_s))


def link_load_cap(transfer_s: float, ttft_s: float | None) -> float:
    """Largest load ρ ∈ [0, 1] of a processor-shared link at which a transfer of ``transfer_s``
    seconds alone spends at most ``ttft_s`` on it on average: s / (1 − ρ) ≤ S (module doc)."""
    if ttft_s is None:
        return 1.0
    if transfer_s >= ttft_s:
        return 0.0
    return 1.0 - transfer_s / ttft_s


def kv_loads_within(loads: dict[str, float], resources: dict[str, Resource],
                    slo: SLOTargets | None) -> dict[str, float] | None:
    """A KV route's bytes per request on each shared resource as the flow network charges them
    within ``slo``: bytes / ``link_load_cap`` (module doc); None when on some resource the
    route's KV alone takes the TTFT target (the route carries nothing within the SLOs)."""
    ttft = None if slo is None else slo.ttft_s
    if ttft is None:
        return loads
    out = {}
    for name, b in loads.items():
        cap = link_load_cap(b / resources[name].bandwidth, ttft)
        if cap <= 0:
            return None
        out[name] = b / cap
    return out


def decode_batch_within(cost, layout: ReplicaLayout, input_tokens: float, output_tokens: float,
                        tpot_s: float | None) -> int:
    """Largest decode batch (≤ the memory / engine cap) whose step time meets ``tpot_s``."""
    top = cost.max_decode_batch(layout, input_tokens + output_tokens)
    if tpot_s is None or top == 0:
        return top
    ctx_per = input_tokens + output_tokens / 2

    def ok(b: int) -> bool:
        return cost.decode_step_time(layout, b, b * ctx_per) <= tpot_s

    if ok(top):
        return top
    lo, hi = 0, top  # ok(lo) (0 trivially), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def slo_batch(cost, layout: ReplicaLayout, role: str, input_tokens: float, output_tokens: float,
              slo: SLOTargets) -> int:
    """The decode batch a decode or colocated replica runs within the TPOT target (see above)."""
    tpot = slo.tpot_s
    if role == "colocated" and tpot is not None:
        tpot *= COLOCATED_TPOT_SHARE
    return decode_batch_within(cost, layout, input_tokens, output_tokens, tpot)


def slo_capacity(cost, layout: ReplicaLayout, role: str, input_tokens: float, output_tokens: float,
                 period_s: float, slo: SLOTargets) -> float:
    """Requests per ``period_s`` that ``layout`` serves in ``role`` within ``slo`` (see above)."""
    prompt = max(1, round(input_tokens))
    if role == "prefill":
        s = cost.ttft(layout, prompt)
        return period_s / s * ttft_load_cap(s, slo.ttft_s)
    b = slo_batch(cost, layout, role, input_tokens, output_tokens, slo)
    if b == 0:
        return 0.0
    step = cost.decode_step_time(layout, b, b * (input_tokens + output_tokens / 2))
    tokens_per_s = b / step
    if role == "decode":
        return min(period_s * tokens_per_s / max(output_tokens, 1.0),
                   cost.decode_capacity(layout, input_tokens, output_tokens, period_s))
    ttft = cost.ttft(layout, prompt)
    per_request = ttft + output_tokens / tokens_per_s
    return min(period_s / per_request * ttft_load_cap(ttft, slo.ttft_s),
               cost.colocated_capacity(layout, input_tokens, output_tokens, period_s))
