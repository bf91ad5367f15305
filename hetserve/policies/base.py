"""What every policy sees and decides: snapshots in, decisions out.

Policies are pure decisions over a snapshot of state, so the simulator and the live runtime
drive the very same classes (docs/design.md, "policies"). Nothing here imports torch, the simulator
or the runtime; the caller builds the snapshot from whatever state it keeps.

Three kinds of decision:

* **placement** — which replica takes a newly arrived request (``PlacementPolicy.choose``);
* **KV route** — which decode replica receives a finished prefill (``RoutePolicy.choose``);
* **transmission** — on one link, what to send next and how much (``TransmissionPolicy.schedule``).

Snapshot invariants: ids are unique within one snapshot; token counts are non-negative;
``kv_capacity_tokens`` is the replica's KV pool size (0 for a prefill-only replica, which frees
KV as it hands it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, Sequence

from hetserve.policies.outstanding import outstanding_at_least

TrafficKind = Literal["decode", "prefill", "kv"]


@dataclass(frozen=True)
class RequestInfo:
    """A request as a policy sees it on arrival."""

    id: int
    arrival_s: float
    input_tokens: int
    predicted_output_tokens: float  # from an output-length predictor (or the true value in oracle runs)


@dataclass(frozen=True)
class RunningRequest:
    """A request already placed on a replica (for policies that reason per request, e.g. Aladdin)."""

    id: int
    input_tokens: int
    generated_tokens: int
    predicted_output_tokens: float
    decode_time_s: float = 0.0  # time spent in decode so far (Aladdin constraint (d): ATGT slack)
    started: bool = True  # False: placed but still waiting for its prefill


@dataclass(frozen=True)
class ReplicaState:
    """One replica at the moment of a decision."""

    id: str
    role: Literal["prefill", "decode", "colocated"]
    queued_requests: int  # waiting, not yet running
    running_requests: int  # in the running batch
    queued_prefill_tokens: int  # prompt tokens waiting for prefill
    outstanding_tokens: float  # prompt tokens to prefill + output tokens still to generate (predicted)
    context_tokens: int  # Σ current context of running requests
    kv_used_tokens: int
    kv_capacity_tokens: int
    # may be empty when the caller keeps only aggregates; may be a lazy sequence (built on first
    # access) so a policy that decides on the aggregates alone pays nothing per queued request
    requests: Sequence[RunningRequest] = ()
    capacity_norm: float = 1.0  # relative capacity (Aladdin ranks workers by it)
    # seconds until the replica can start its next prefill: the rest of the prefill (or decode
    # iteration) now running; 0 when idle or unknown (Aladdin constraint (c))
    prefill_wait_s: float = 0.0
    # seconds the oldest prompt waiting for prefill has waited (0: none waiting, or unknown): a new
    # prompt that joins its prefill batch lengthens that batch (Aladdin constraint (c))
    queued_age_s: float = 0.0
    alive: bool = True  # False: the replica lost a worker; no policy may choose it
    preemptions: int = 0  # requests pre-empted here so far (paged KV admission; counted, for metrics)

    # (not a field: left out of equality, ``replace`` and the runtime's snapshots) a lower bound on
    # ``outstanding_tokens`` for as long as this snapshot is read (0: they are never negative); a
    # simulator's snapshot whose figures move with the clock sets it on itself, so a policy passes
    # over a candidate that cannot win without working its figures out
    outstanding_floor = 0.0
    # (not a field, as above) ``(t, tokens, rate)``: at any moment ``now >= t`` this snapshot is read,
    # ``outstanding_tokens >= tokens - rate·(now - t)`` (a running batch drains its backlog no
    # faster); None: no such bound
    outstanding_drain: ClassVar[tuple[float, float, float] | None] = None

    @property
    def load(self) -> int:
        return self.queued_requests + self.running_requests

    def outstanding_at_least(self, now: float) -> float:
        """A lower bound on ``outstanding_tokens`` at ``now`` (the snapshot's clock; inf: any
        moment) from ``outstanding_floor`` and ``outstanding_drain``, without working it out."""
        return outstanding_at_least(self, now)


class PlacementPolicy(Protocol):
    """Choose the replica for a new request among ``candidates`` (never empty).

    Optional class attributes tell a caller what it may leave out of the snapshots:
    ``needs_requests`` (default False): ``ReplicaState.requests`` is read; ``reads_waits``
    (default True): ``prefill_wait_s`` / ``queued_age_s`` are read — they move with the clock even
    while nothing else about a replica changes, so a caller keeping snapshots between decisions
    brings them up to date only for a policy that reads them. ``picks_least_loaded`` (default
    False; True with ``choose_lowest``): ``choose`` reads only the candidates of the least ``load``;
    ``choose_lowest(request, least, now)``, given those alone (``policies.outstanding.LeastLoaded``:
    their ids, outstanding tokens and lower bounds on them, by position in candidate order),
    decides as ``choose`` over all of them would, so a caller filing its replicas by load need not
    read every one."""

    name: str

    def choose(self, request: RequestInfo, candidates: Sequence[ReplicaState], now: float) -> str: ...

    def on_finish(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        """Learn from a finished request (predictors, re-balancing). Default: nothing."""


class RoutePolicy(Protocol):
    """Choose the decode replica for a finished prefill among the routes out of its replica."""

    name: str

    def choose(self, request: RequestInfo, src: str, candidates: Sequence[tuple[ReplicaState, float]],
               now: float) -> str: ...


# ----------------------------------------------------------------------------- transmission


@dataclass(frozen=True)
class TransferView:
    """A message waiting (possibly partly sent) on one link."""

    id: Any  # any message id the caller keys its messages by
    kind: TrafficKind  # decode activations are small and latency-critical; prefill / kv are bulk
    total_bytes: float
    remaining_bytes: float
    enqueued_s: float


@dataclass(frozen=True)
class DecodeTiming:
    """The sending server's decode executions, for MoLink's just-in-time chunk sizing (§4.2).

    Times are absolute (same clock as ``now``). ``exec_start_s`` / ``exec_duration_s`` describe the
    decode micro-batch executing now or next on the sender (t_s, T_d); ``None`` start: no decode
    batch is executing or scheduled (the iteration's last batch has left). ``iteration_first_done_s``
    (t_p) is when the first decode micro-batch of the latest iteration finished here, and
    ``round_trip_s`` (T_o + T_m) the time that batch needs to come back round the pipeline.
    """

    exec_start_s: float | None = None
    exec_duration_s: float = 0.0
    iteration_first_done_s: float | None = None
    round_trip_s: float = 0.0


@dataclass(frozen=True)
class LinkInfo:
    latency_s: float
    bandwidth: float  # bytes/s
    decode: DecodeTiming | None = None  # sender's decode timings (MoLink chunk sizing); None: unknown


@dataclass(frozen=True)
class Send:
    """Send ``nbytes`` of transfer ``id`` now (a chunk when less than what remains)."""

    id: Any
    nbytes: float


@dataclass(frozen=True)
class Allocation:
    """What to put on the wire until the next decision.

    ``concurrent`` False: the sends go one after another in list order (each gets the whole link).
    ``concurrent`` True: the sends share the link equally (fair-share, as vLLM / Helix do).
    The caller asks again when the allocation finishes or a new transfer arrives.
    """

    sends: tuple[Send, ...]
    concurrent: bool = False


class TransmissionPolicy(Protocol):
    name: str

    def schedule(self, pending: Sequence[TransferView], link: LinkInfo, now: float,
                 next_decode_in_s: float | None = None) -> Allocation:
        """Decide what to send. ``next_decode_in_s``: predicted time until the next decode message
        arrives on this link (for MoLink's just-in-time chunk sizing; None if unknown)."""
        ...
