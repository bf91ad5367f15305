"""``SimOptions``: the knobs of one simulation run, checked where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hetserve.policies.base import PlacementPolicy, RoutePolicy, TransmissionPolicy
from hetserve.policies.batching import DEFAULT_BATCHING, PREFILL_MODES
from hetserve.policies.placement import DEFAULT_PLACEMENT
from hetserve.policies.routing import DEFAULT_ROUTE
from hetserve.policies.transmission import DEFAULT_TRANSMISSION
from hetserve.sim.option_checks import PAGED_IS_AGGREGATE
from hetserve.specs.workload import SLO


@dataclass(frozen=True)
class SimOptions:
    """Knobs of one simulation run (policies by registry name or as objects)."""

    placement: str | PlacementPolicy = DEFAULT_PLACEMENT
    route: str | RoutePolicy = DEFAULT_ROUTE
    transmission: str | TransmissionPolicy = DEFAULT_TRANSMISSION
    # Output-length predictor (hetserve.policies.predictor protocol: predict(rid, input, generated=0),
    # observe(rid, input, output)); None = oracle, the true length.
    predictor: Any = None
    slo: SLO = field(default_factory=SLO)
    # Batching: the runtime's defaults (policies.batching.BatchingConfig), one set for both.
    token_budget: int = DEFAULT_BATCHING.token_budget  # tokens per step (decode + prompt tokens)
    chunked_prefill: bool = False  # colocated replicas: Sarathi/vLLM chunked prefill (prefill_mode "chunked")
    chunk_tokens: int = DEFAULT_BATCHING.chunk_tokens  # tokens per mixed iteration with chunked prefill
    # colocated replicas: "mixed" (the runtime: whole prompts ride in the decode step) or
    # "prefill_first" (vLLM v0: a prompts-only step pauses decoding); chunked_prefill wins
    prefill_mode: str = DEFAULT_BATCHING.prefill_mode
    max_batch: int | None = None  # running requests per decode / colocated replica; None: the cost model's
    kv_block_tokens: int = DEFAULT_BATCHING.block_size  # KV reservations are whole blocks
    # KV pool per replica in tokens (one number, or replica id -> tokens); None: the cost model's
    # (the runtime's EngineConfig.kv_capacity_tokens, so a replay can give both the same pool)
    kv_capacity_tokens: int | dict[str, int] | None = None
    micro_batches: int | None = None  # pipeline micro-batches (None: the cost model's min(S, batch))
    pipeline: Literal["aggregate", "detailed"] = "aggregate"
    # KV admission on decode / colocated replicas: "reserve" holds prompt + whole (true) output from
    # admission, so the pool never overflows; "paged" (vLLM) holds what the context has grown to,
    # admits while the prompt fits, and pre-empts the newest request (recompute) on overflow.
    kv_admission: Literal["reserve", "paged"] = "reserve"
    # A request longer than the model's context (prompt + output): "reject" it at arrival, as a
    # served deployment does (counted as rejected, not completed), or "run" it as given, as a model
    # with a longer context would. A request whose KV no replica could ever hold is rejected either way.
    beyond_context: Literal["reject", "run"] = "reject"
    # What a served request spends outside the engine (HTTP, tokenisation, SSE; `hetserve calibrate`
    # measures it): it reaches the replicas this long after its arrival, and TTFT/E2E count it.
    request_overhead_s: float = 0.0
    # CPU worker slots sharing a host's cores (cluster file `cpu_cores`): how much one worker slows
    # down per other worker computing on its host at the same time (`hetserve calibrate` measures it;
    # 1: only the cores' share, k busy workers on c cores run at c / k of their speed).
    contention_slowdown: float = 1.0
    # The serving front end (coordinator, HTTP/SSE server, and the replaying client where it runs
    # beside them) as one more CPU consumer on the first replica's host, when that host's slots
    # share cores (``sim.hosts``): CPU seconds per request, per engine step and per output token (`hetserve
    # calibrate` measures them; 0: no front end on the host's cores).
    frontend_request_cpu_s: float = 0.0
    frontend_step_cpu_s: float = 0.0
    frontend_token_cpu_s: float = 0.0
    # seconds a replica's next step waits for the front end (one GIL) per unit of the front end's
    # utilisation by other work (``sim.hosts``; `hetserve calibrate` measures it; 0: no wait)
    frontend_dispatch_s: float = 0.0
    # seconds each decoding step waits for the front end to stream its tokens, beyond their
    # per-sequence cost (the fixed part of a step's SSE events; `hetserve calibrate` measures it)
    stream_step_overhead_s: float = 0.0
    seed: int = 0
    policy_options: dict[str, Any] = field(default_factory=dict)  # PolicyContext.options (e.g. Aladdin's gamma)
    # the link model's calibration knobs (hetserve.policies.links): seconds added per message, and
    # the share of a resource's capacity lost per extra competing send (0, 0: the plain model)
    link_overhead_s: float = 0.0
    link_competing_penalty: float = 0.0
    progress: bool = False

    def __post_init__(self) -> None:
        if self.token_budget <= 0 or self.chunk_tokens <= 0 or (self.max_batch is not None and self.max_batch <= 0):
            raise ValueError("token_budget, chunk_tokens and max_batch must be positive")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}")
        if self.contention_slowdown < 1:
            raise ValueError("contention_slowdown must be at least 1")
        if self.request_overhead_s < 0:
            raise ValueError("request_overhead_s must be non-negative")
        if min(self.frontend_request_cpu_s, self.frontend_step_cpu_s, self.frontend_token_cpu_s,
               self.frontend_dispatch_s, self.stream_step_overhead_s) < 0:
            raise ValueError("frontend_request_cpu_s, frontend_step_cpu_s, frontend_token_cpu_s, "
                             "frontend_dispatch_s and stream_step_overhead_s must be non-negative")
        if self.kv_block_tokens <= 0:
            raise ValueError("kv_block_tokens must be positive")
        if self.micro_batches is not None and self.micro_batches <= 0:
            raise ValueError("micro_batches must be positive")
        if self.pipeline not in ("aggregate", "detailed"):
            raise ValueError("pipeline must be 'aggregate' or 'detailed'")
        if self.kv_admission not in ("reserve", "paged"):
            raise ValueError("kv_admission must be 'reserve' or 'paged'")
        if self.beyond_context not in ("reject", "run"):
            raise ValueError("beyond_context must be 'reject' or 'run'")
        if self.kv_admission == "paged" and self.pipeline == "detailed":
            raise ValueError(f"kv_admission='paged' with pipeline='detailed': {PAGED_IS_AGGREGATE}")
