"""Transmission scheduling on one link (MoLink §3.2, §4.2, §4.3).

Three policies answer ``schedule(pending, link, now, next_decode_in_s) -> Allocation``:

* ``serial`` — FIFO, one whole message at a time (Helix's ordered queue; MoLink Fig. 3b).
* ``fair`` — every pending message at once, sharing the link equally (vLLM's asynchronous sends;
  MoLink Fig. 3c).
* ``molink`` — decode-first weighted priority with an anti-starvation weight (Algorithm 1, N = 30)
  and just-in-time chunks of bulk (prefill / KV) traffic sized to end before the next decode
  message needs the link (§4.2, three cases).

Plus ``choose_micro_batches``: the micro-batch count in N..2N for a pipeline of degree N, found by
emulating a few decode iterations of the pipeline (§4.3).

The caller asks again when an allocation finishes or a new message arrives; policies keep only
their own small state (MoLink's weight W), never the caller's.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

from hetserve.compiled import mypyc_attr
from hetserve.policies.base import Allocation, DecodeTiming, LinkInfo, Send, TransferView

M = TypeVar("M")  # a caller's pending-message record; it must have ``remaining`` (bytes)

MOLINK_MAX_WAIT = 30  # Algorithm 1, line 3: N = 30


def _fifo(pending: Sequence[TransferView]) -> list[TransferView]:
    return sorted(pending, key=lambda t: (t.enqueued_s, t.id))


@mypyc_attr(allow_interpreted_subclasses=True)
class SerialTransmission:
    """FIFO: the oldest message goes whole; the rest wait behind it."""

    name = "serial"
    replan_once = True  # the allocation depends on the pending messages alone (``LinkModel.put_many``)

    def schedule(self, pending: Sequence[TransferView], link: LinkInfo, now: float,
                 next_decode_in_s: float | None = None) -> Allocation:
        return Allocation(tuple(Send(t.id, t.remaining_bytes) for t in _fifo(pending)), concurrent=False)


@mypyc_attr(allow_interpreted_subclasses=True)
class FairTransmission:
    """Fair share: every pending message at once, each with 1/n of the link."""

    name = "fair"
    replan_once = True  # the allocation depends on the pending messages alone (``LinkModel.put_many``)
    # the allocation is every pending message whole, oldest first, concurrent: a link model may
    # build it without asking (``SenderQueue.replan``); ``schedule`` says the same for other callers
    sends_all_pending = True

    def schedule(self, pending: Sequence[TransferView], link: LinkInfo, now: float,
                 next_decode_in_s: float | None = None) -> Allocation:
        return Allocation(tuple(Send(t.id, t.remaining_bytes) for t in _fifo(pending)), concurrent=True)


# ----------------------------------------------------------------------------- MoLink


@dataclass(frozen=True)
class ChunkWindow:
    """The result of just-in-time chunk sizing: which case of §4.2 applied and the time T_a."""

    case: int  # 1, 2, 3; 0 = only a bare next_decode_in_s hint; -1 = nothing known
    available_s: float  # T_a


def available_time(now: float, timing: DecodeTiming | None, next_decode_in_s: float | None = None) -> ChunkWindow:
    """T_a, the time a bulk chunk may hold the link before the next decode message needs it.

    Case 1 (t_c = t_s): a decode batch starts now: T_a = T_d.
    Case 2 (t_c > t_s, batch still running): T_a = t_s + T_d − t_c.
    Case 3 (no batch running: the iteration's last batch has left): the next decode output is
    batch B1, the next to execute, coming back round the pipeline: T_a = t_p + T_o + T_m − t_c
    (the caller picks B1 as the group expected back first: ``next_decode_return``).
    Without ``timing``, ``next_decode_in_s`` (the caller's own prediction) is T_a.
    """
    eps = 1e-9
    if timing is not None:
        t_s, t_d = timing.exec_start_s, timing.exec_duration_s
        if t_s is not None and abs(now - t_s) <= eps:
            return ChunkWindow(1, t_d)
        if t_s is not None and t_s < now < t_s + t_d:
            return ChunkWindow(2, t_s + t_d - now)
        if t_s is not None and t_s > now:  # the next batch has a known start: it ends at t_s + T_d
            return ChunkWindow(3, t_s + t_d - now)
        if timing.iteration_first_done_s is not None:
            return ChunkWindow(3, max(0.0, timing.iteration_first_done_s + timing.round_trip_s - now))
    if next_decode_in_s is not None:
        return ChunkWindow(0, max(0.0, next_decode_in_s))
    return ChunkWindow(-1, math.inf)


def round_trip_time(stage_times_s: Sequence[float], latencies_s: Sequence[float], bandwidths: Sequence[float],
                    act_bytes_per_token: float, token_bytes: float, tokens: float) -> float:
    """T_o + T_m of §4.2: B1's compute on every server plus its hops round the ring.

    ``stage_times_s[i]``: T_{d_i}(n) on server i. ``latencies_s[i]`` / ``bandwidths[i]``: the link
    from server i to i+1 (the last one back to server 1, carrying sampled token ids only).
    """
    m = len(stage_times_s)
    if len(latencies_s) != m or len(bandwidths) != m:
        raise ValueError("need one link (latency, bandwidth) per server, the last closing the ring")
    t_o = sum(stage_times_s)
    # the hops' sum on a line of its own: mypyc types ``sum(...) + sum(<generator>)`` as an int
    hops: float = sum(act_bytes_per_token * tokens / bandwidths[i] for i in range(m - 1))
    t_m = sum(latencies_s) + hops
    t_m += token_bytes * tokens / bandwidths[m - 1]
    return t_o + t_m


def next_decode_return(returns: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Case 3's (t_p, T_o + T_m): of the micro-batch groups in flight, the one expected back first.

    §4.2, case 3: "we consider the finishing time t_f of the next decode execution ... The batch B_1
    is expected to be the next to execute, as indicated by dec* in Figure 5. Hence, we focus on the
    start time (i.e., arrival time) of the next execution of B_1". B_1 is named as *the next to
    execute*: in the paper's strict round robin that is the iteration's first batch. With more groups
    than stages, or groups that stall on a prefill, the next decode back at this server is whichever
    group's t_p + T_o + T_m is earliest, not always group 0's, so we take the minimum over all of
    them (docs/policies.md). ``returns``: (t_p, T_o + T_m) per group; empty: ``None``.
    """
    return min(returns, key=lambda r: r[0] + r[1], default=None)


@mypyc_attr(allow_interpreted_subclasses=True)
class MoLinkTransmission:
    """Decode-first weighted priority with just-in-time chunking (MoLink Algorithm 1).

    Decode messages go first, whole. Each decode message sent while bulk traffic waits raises the
    waiting weight W; at W ≥ ``max_wait`` (N = 30) the head bulk message goes — whole — even with
    decode traffic queued, and W resets. Otherwise bulk traffic goes as one chunk of
    ``T_a · bandwidth`` bytes (``available_time``), at least ``min_chunk_s`` of link time so it
    always progresses, and W resets after every bulk send (Algorithm 1, line 24).
    """

    name = "molink"

    def __init__(self, max_wait: int = MOLINK_MAX_WAIT, min_chunk_s: float = 0.002, chunking: bool = True):
        if max_wait < 1 or min_chunk_s <= 0:
            raise ValueError("max_wait must be >= 1 and min_chunk_s positive")
        self.max_wait, self.min_chunk_s, self.chunking = int(max_wait), float(min_chunk_s), chunking
        self.wait = 0  # W
        self._counted: set[int] = set()  # decode messages already counted in W
        self.last_window: ChunkWindow | None = None

    def chunk_bytes(self, remaining: float, link: LinkInfo, now: float, next_decode_in_s: float | None) -> float:
        """``chunk(vq2[0].left)``: what fits before the next decode message (never below the floor)."""
        if not self.chunking:
            return remaining
        win = available_time(now, link.decode, next_decode_in_s)
        self.last_window = win
        if math.isinf(win.available_s):
            return remaining
        return min(remaining, max(win.available_s, self.min_chunk_s) * link.bandwidth)

    def schedule(self, pending: Sequence[TransferView], link: LinkInfo, now: float,
                 next_decode_in_s: float | None = None) -> Allocation:
        decode = [t for t in _fifo(pending) if t.kind == "decode"]
        bulk = [t for t in _fifo(pending) if t.kind != "decode"]
        self._counted &= {t.id for t in decode}  # forget messages that are gone
        if decode and (not bulk or self.wait < self.max_wait):
            head = decode[0]
            if bulk and head.id not in self._counted:  # line 10-11: a decode win over waiting bulk
                self.wait += 1
                self._counted.add(head.id)
            return Allocation((Send(head.id, head.remaining_bytes),))
        if bulk:
            head = bulk[0]
            if self.wait >= self.max_wait:  # lines 16-17: starved long enough, send it all
                nbytes = head.remaining_bytes
            else:
                nbytes = self.chunk_bytes(head.remaining_bytes, link, now, next_decode_in_s)
            self.wait = 0  # line 24
            return Allocation((Send(head.id, nbytes),))
        return Allocation(())


def resolve_allocation(policy, pending: "Mapping[int, M]", views: Sequence[TransferView], link: LinkInfo,
                       now: float, next_decode_in_s: float | None) -> tuple[list[tuple[M, float]], bool]:
    """Ask ``policy`` what to send and check the answer against what is ``pending`` (by id).

    Returns ``(sends, concurrent)``: the messages with the bytes to put on the wire now, and
    whether they share the link. A sequential allocation keeps only its first send (the caller
    asks again when it finishes). The simulator's links and the runtime's shaped links both
    call this, so the allocation rules live in one place.
    """
    alloc: Allocation = policy.schedule(views, link, now, next_decode_in_s)
    sends: list[tuple[M, float]] = []
    for s in alloc.sends:
        m = pending.get(s.id)
        if m is None or s.nbytes <= 0:
            raise ValueError(f"transmission policy {policy.name!r} sent {s}, which is not pending")
        sends.append((m, min(float(s.nbytes), m.remaining)))  # type: ignore[attr-defined]
    if not sends:
        raise ValueError(f"transmission policy {policy.name!r} sent nothing with {len(views)} messages pending")
    concurrent = bool(alloc.concurrent)
    return (sends if concurrent else sends[:1]), concurrent


# What a link does when no policy is named, in the simulator and in the server alike: every pending
# message shares the link, as the engine's asynchronous socket sends do on an unshaped link.
DEFAULT_TRANSMISSION = "fair"

TRANSMISSION_POLICIES: dict[str, Callable[[], object]] = {
    "serial": SerialTransmission,
    "fair": FairTransmission,
    "molink": MoLinkTransmission,
}


def transmission_names() -> list[str]:
    return sorted(TRANSMISSION_POLICIES)


def make_transmission(name: str, **kwargs):
    """A fresh policy instance by name (one per link: MoLink keeps per-link state)."""
    try:
        return TRANSMISSION_POLICIES[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown transmission policy {name!r}; choose one of "
                         + ", ".join(transmission_names())) from None


# ----------------------------------------------------------------------------- micro-batches (§4.3)


@dataclass(frozen=True)
class MicroBatchChoice:
    micro_batches: int
    tokens_per_s: float
    table: tuple[tuple[int, float], ...]  # (m, tokens/s) for every m tried


def emulate_pipeline(batch: int, m: int, stage_time: Sequence[Callable[[float], float]],
                     hop_latency_s: Sequence[float], hop_bandwidth: Sequence[float],
                     act_bytes_per_seq: float, token_bytes_per_seq: float, iterations: int = 6) -> float:
    """Decode tokens/s of a pipeline running ``batch`` sequences as ``m`` micro-batches.

    Servers run one micro-batch at a time in arrival order; each hop is a FIFO link (a message
    holds it for bytes/bandwidth, then flies for its latency); hop i goes from server i to i+1
    and the last hop carries token ids back to server 0 for the next iteration.
    Running time O(iterations · m · N log m).
    """
    n = len(stage_time)
    if len(hop_latency_s) != n or len(hop_bandwidth) != n:
        raise ValueError("need one hop per server (the last closes the ring)")
    m = max(1, min(m, batch))
    sizes = [batch // m + (1 if k < batch % m else 0) for k in range(m)]
    times = [[f(s) for s in sizes] for f in stage_time]  # times[server][micro-batch]
    server_free = [0.0] * n
    link_free = [0.0] * n
    ready = [(0.0, k, 0, 0) for k in range(m)]  # (time, mb, server, iteration)
    heapq.heapify(ready)
    done_at = 0.0
    while ready:
        t, k, s, it = heapq.heappop(ready)
        start = max(t, server_free[s])
        end = start + times[s][k]
        server_free[s] = end
        nbytes = (act_bytes_per_seq if s < n - 1 else token_bytes_per_seq) * sizes[k]
        send = max(end, link_free[s])
        link_free[s] = send + nbytes / hop_bandwidth[s]
        arrive = link_free[s] + hop_latency_s[s]
        nxt, nit = (s + 1) % n, it + (1 if s == n - 1 else 0)
        if nit < iterations:
            heapq.heappush(ready, (arrive, k, nxt, nit))
        else:
            done_at = max(done_at, arrive)
    return batch * iterations / done_at if done_at > 0 else 0.0


def choose_micro_batches(batch: int, stage_time: Sequence[Callable[[float], float]],
                         hop_latency_s: Sequence[float], hop_bandwidth: Sequence[float],
                         act_bytes_per_seq: float, token_bytes_per_seq: float = 8.0,
                         degree: int | None = None, iterations: int = 6) -> MicroBatchChoice:
    """MoLink §4.3: try every micro-batch count in N..2N (N = pipeline degree, capped by the
    batch) and keep the one with the highest emulated decode throughput (ties: the smaller)."""
    n = degree or len(stage_time)
    if n < 1 or batch < 1:
        raise ValueError("pipeline degree and batch must be positive")
    table: list[tuple[Any, Any]] = []
    for m in range(n, 2 * n + 1):
        if m > batch and table:
            break
        mm = min(m, batch)
        table.append((mm, emulate_pipeline(batch, mm, stage_time, hop_latency_s, hop_bandwidth,
                                           act_bytes_per_seq, token_bytes_per_seq, iterations)))
    best = max(table, key=lambda x: (x[1], -x[0]))
    return MicroBatchChoice(best[0], best[1], tuple(table))
