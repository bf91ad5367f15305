"""What a simulated replica sees of the simulation around it: ``ReplicaEnv``.

Replicas hold state and price their work with the cost model; everything that crosses replicas
(placing a finished prefill, moving KV, recording a finished request, re-asking the predictor)
goes through these few calls, so a replica never reaches into the ``Simulator`` itself and the
simulator module is the only one that knows every replica kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.cost.analytic import CostModel
    from hetserve.sim.events import EventLoop
    from hetserve.sim.links import Network
    from hetserve.sim.requests import RequestTable


@dataclass(frozen=True)
class BatchLimits:
    """The batching knobs a replica reads (filled from ``SimOptions``)."""

    token_budget: int  # tokens per step (policies.batching.StepBuilder)
    chunk_tokens: int  # tokens per mixed iteration with chunked prefill (decode tokens included)
    prefill_mode: str  # "mixed" | "prefill_first" | "chunked" (policies.batching)
    max_batch: int  # running requests per decode / colocated replica
    micro_batches: int | None  # pipeline micro-batches (None: the cost model's)
    paged: bool  # KV admission "paged" (vLLM) rather than "reserve"
    block_size: int = 16  # KV reservations are whole blocks of this many tokens


class ReplicaEnv(Protocol):
    """The narrow interface between a replica and the simulation that drives it."""

    loop: "EventLoop"
    cost: "CostModel"
    req: "RequestTable"
    network: "Network"
    limits: BatchLimits
    activation_bytes: int  # bytes of one token's activations between pipeline stages

    def first_token(self, rid: int) -> None:
        """Request ``rid`` emitted its first token now."""

    def prefill_done(self, rid: int, src) -> None:
        """A prefill replica finished ``rid``'s prompt: route it to a decode replica."""

    def start_kv(self, rid: int, src, dst) -> None:
        """Move ``rid``'s prompt KV from prefill replica ``src`` to decode replica ``dst``."""

    def recompute(self, rid: int) -> None:
        """``rid`` was pre-empted on a decode replica: its prefill replica recomputes it."""

    def finished(self, rid: int) -> None:
        """Request ``rid`` emitted its last token now."""

    def repredict(self, rid: int, generated: int) -> float:
        """``rid``'s predicted output, re-asked once it has outlived the prediction."""

    def slowdown(self, replica, own_workers: float | None = None) -> float:
        """Factor on the work ``replica`` starts now (CPU worker slots sharing a host's cores);
        ``own_workers``: its own workers computing then, where the caller counts them itself."""

    def host_changed(self, replica) -> None:
        """``replica`` started or ended a piece of work on a host whose cores it shares: the work
        running beside it there is re-priced (``sim.hosts``)."""

    def dispatch_wait(self, replica, decodes: bool = True) -> float:
        """Seconds ``replica``'s next step waits for the serving front end (its GIL, and where the
        step ``decodes``, its tokens' fixed streaming part) beyond what the cost model prices
        (``sim.hosts``)."""
