"""``EngineConfig``: the engine's knobs, and how big each replica's KV pool is.

The KV pool of a replica is what its config asks for (checked against the memory its smallest
device has left next to its weights) or, when nothing is asked, what that memory allows (capped on
CPU, where the device memory of the cluster file is fictional).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from collections.abc import Callable

from hetserve.cost.efficiency import Efficiency
from hetserve.errors import PlanError, RuntimeFailure
from hetserve.cost.layout import micro_batches_of
from hetserve.policies.batching import DEFAULT_BATCHING, token_budget_rule
from hetserve.policies.kv_admission import KV_ADMISSIONS, pool_tokens
from hetserve.runtime.workers import DEVICE_CHANNELS
from hetserve.runtime.workers.auth import TLSFiles
from hetserve.runtime.workers.rendezvous import PortRange
from hetserve.runtime.deployment import check_memory
from hetserve.runtime.layout import ReplicaSpec
from hetserve.runtime.kv_cache import BlockManager
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.scheduler import ReplicaScheduler
from hetserve.runtime.workers.wire import MAX_HEADER_BYTES
from hetserve.specs.cluster import Cluster

START_METHOD_ENV = "HETSERVE_START_METHOD"  # the workers' start method where a config names none


@dataclass(frozen=True)
class EngineConfig:
    kv_capacity_tokens: int | dict[str, int] | None = None  # per replica; None: what memory allows, capped
    default_kv_tokens: int = 16384  # the cap on CPU, where device memory in the cluster file is fictional
    # batching: the defaults the simulator uses too (policies.batching.BatchingConfig)
    block_size: int = DEFAULT_BATCHING.block_size
    max_num_seqs: int = DEFAULT_BATCHING.max_batch  # per step
    max_batched_tokens: int = DEFAULT_BATCHING.token_budget  # per step, prompt tokens + decode tokens
    prefill_mode: str = DEFAULT_BATCHING.prefill_mode  # "mixed" | "chunked" (colocated replicas)
    chunk_tokens: int = DEFAULT_BATCHING.chunk_tokens  # chunked: tokens per step, decode tokens included
    # "reserve": prompt + max_tokens held from admission; "paged": vLLM's blocks as the context grows,
    # pre-empting (recompute) the latest arrival when a step would not fit (policies.kv_admission)
    kv_admission: str = DEFAULT_BATCHING.kv_admission
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on CUDA
    # torch intra-op threads of each worker process; None: the host's cores divided among the workers
    # placed on it (``worker_threads``). Calibration passes 1: its figures are one thread's.
    threads_per_worker: int | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    # of each device's memory the weights, activation buffers and KV may fill: the planner's usable memory
    memory_fraction: float = Efficiency.usable_memory
    start_timeout_s: float = 120.0
    micro_batches: int | None = None  # steps in flight per replica; None: its number of pipeline stages
    # "spawn", or "forkserver": workers fork from a server that imported torch once (a second, not
    # seconds, per worker). Default: $HETSERVE_START_METHOD, else spawn: a fork server keeps the
    # environment it started with, so an OpenMP setting made for later workers would not reach them
    start_method: str = field(default_factory=lambda: os.environ.get(START_METHOD_ENV, "spawn"))
    # tensors between workers by a device channel (runtime/workers/device_channel.py): "off", "auto"
    # (pairs of GPUs: NCCL / CUDA IPC) or "on" (gloo between CPU workers too: the same code path, no
    # faster than the socket on CPU). Off until the GPU kinds have run on a GPU (bench/gpu/dataflow.sh)
    device_channel: str = "off"  # one of DEVICE_CHANNELS
    channel_timeout_s: float = 30.0  # a channel transfer not done by then goes by socket
    heartbeat_interval_s: float = 0.5  # each worker reports it is alive this often
    heartbeat_timeout_s: float = 3.0  # silent this long (a hung or SIGSTOPped worker): declared dead
    max_reruns: int = 3  # a request whose replica died is re-run on a live one at most this many times
    # the address the engine's endpoint and TP rendezvous store bind and advertise to the workers: one
    # address their nodes can reach, never all interfaces; None: 127.0.0.1 (the Ray backend: its node IP)
    host: str | None = None
    # the ports the engine's endpoint, its TP rendezvous store and every worker's endpoint take theirs
    # from, on each one's machine (rendezvous.PortRange, "LO-HI" or (lo, hi)); None: ports the OS picks.
    # gloo's and NCCL's own sockets are not in it
    port_range: PortRange | None = None
    tls: TLSFiles | None = None  # TLS on every link between the engine and its workers (runtime/workers/auth.py)

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_num_seqs, self.max_batched_tokens, self.chunk_tokens) < 1:
            raise ValueError("block_size, max_num_seqs, max_batched_tokens and chunk_tokens must be positive")
        budget = token_budget_rule(self.max_batched_tokens, self.max_num_seqs, "max_num_seqs",
                                   "prefill_mode='chunked' with chunk_tokens")
        if budget is not None:
            raise ValueError(f"max_batched_tokens must be {budget}, got {self.max_batched_tokens}")
        if self.prefill_mode not in ("mixed", "chunked"):
            raise ValueError(f"prefill_mode must be mixed or chunked, got {self.prefill_mode!r} "
                             "(prefill_first is a simulator what-if)")
        if self.kv_admission not in KV_ADMISSIONS:
            raise ValueError(f"kv_admission must be one of {', '.join(KV_ADMISSIONS)}, got {self.kv_admission!r}")
        if self.start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be spawn or forkserver, got {self.start_method!r} "
                             f"(the default comes from ${START_METHOD_ENV} when it is set)")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"micro_batches must be positive, got {self.micro_batches}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.device_channel not in DEVICE_CHANNELS:
            raise ValueError(f"device_channel must be off, auto or on, got {self.device_channel!r}")
        if not self.channel_timeout_s > 0:
            raise ValueError(f"channel_timeout_s must be positive, got {self.channel_timeout_s}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be positive, got {self.threads_per_worker}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(f"heartbeat interval ({self.heartbeat_interval_s}) must be positive and below the "
                             f"heartbeat timeout ({self.heartbeat_timeout_s})")
        if self.max_reruns < 0:
            raise ValueError(f"max_reruns must be >= 0, got {self.max_reruns}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.host is not None:
            from hetserve.runtime.workers.rendezvous import check_bind_address

            check_bind_address(self.host, "host")
        object.__setattr__(self, "port_range", PortRange.of(self.port_range))  # a ValueError saying what is expected


def memory_is_real(device_of: dict[str, str], cluster: Cluster, use_cuda: bool, one_host: bool) -> bool:
    """Whether the cluster file's device memory is what the workers have: on CUDA, with every plan
    device on a GPU of its own. Plan devices sharing one (more of them than this host has GPUs,
    ``runtime.deployment.local_devices``) would each size a pool to a whole GPU's memory and run it
    out. ``one_host``: every worker runs here (the local backend), so ``cuda:0`` is one GPU whatever
    machines the plan names; else (a launcher placed them, Ray) each machine has its own ``cuda:0``."""
    gpus = {dev if one_host else (cluster.device(d).machine, dev) for d, dev in device_of.items()}
    return use_cuda and len(gpus) == len(device_of)


@dataclass(frozen=True)
class KVPool:
    """One replica's KV pool as sized: ``tokens`` (whole blocks), and why that size (``how``):
    "asked" (``kv_capacity_tokens``), "memory" (what the cluster file's memory leaves, ``room``
    tokens) or "capped" (``default_kv_tokens``: that memory is not what the workers have)."""

    tokens: int
    how: str
    room: int


def kv_capacity(layout: tuple[ReplicaSpec, ...], cluster: Cluster, arch: ArchConfig, dtype: str,
                config: EngineConfig, memory_is_real: bool) -> dict[str, KVPool]:
    """KV pool per replica: asked for (checked against memory) or what memory allows, capped at
    ``config.default_kv_tokens`` unless ``memory_is_real`` (every device a GPU of its own: on CPU, or
    with plan devices sharing a GPU, the cluster file's memory is not what the workers have)."""
    fit = check_memory(layout, cluster, arch, dtype, config.memory_fraction)
    out = {}
    for r in layout:
        asked = config.kv_capacity_tokens
        if isinstance(asked, dict):
            asked = asked.get(r.id)
        if asked is None:
            tokens = fit[r.id] if memory_is_real else min(fit[r.id], config.default_kv_tokens)
            how = "memory" if tokens == fit[r.id] else "capped"
        elif asked > fit[r.id]:
            raise PlanError(f"replica {r.id}: a KV pool of {asked} tokens does not fit next to its weights "
                            f"(at most {fit[r.id]} tokens on its smallest device)")
        else:
            tokens, how = asked, "asked"
        pool = pool_tokens(tokens, config.block_size)
        if pool < 1:
            raise PlanError(f"replica {r.id}: room for {tokens} KV tokens, less than one block of {config.block_size}")
        out[r.id] = KVPool(pool, how, fit[r.id])
    return out


def scheduler_for(r: ReplicaSpec, kv_tokens: int, config: EngineConfig) -> ReplicaScheduler:
    """Replica ``r``'s scheduler: its KV pool of ``kv_tokens`` and the config's batching knobs."""
    return ReplicaScheduler(r.id, r.role, BlockManager(kv_tokens // config.block_size, config.block_size),
                            micro_batches_of(config.micro_batches, len(r.stages)), config.max_num_seqs, config.max_batched_tokens,
                            config.prefill_mode, config.chunk_tokens, config.kv_admission)


def largest_message_bytes(arch: ArchConfig, capacity: dict[str, int], config: EngineConfig) -> int:
    """The most bytes one legitimate message of this deployment carries, with room to spare: the
    bound every endpoint holds a peer's announced size to before allocating for it.

    The largest are a KV hand-off piece (every layer and KV head of the largest context a replica
    holds, or of the model's own context if larger: a re-plan may add roomier replicas) and a
    step's activations (its token budget x hidden size), at 4 bytes an element, the widest dtype
    served; twice that, plus a full header.
    """
    tokens = max(max(capacity.values(), default=0), arch.max_positions, config.max_batched_tokens)
    kv = arch.num_layers * 2 * tokens * arch.num_kv_heads * arch.head_dim * 4
    activations = config.max_batched_tokens * arch.hidden_size * 4
    return 2 * max(kv, activations) + MAX_HEADER_BYTES


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_threads(layout: tuple[ReplicaSpec, ...], config: EngineConfig, host_of: Callable[[str], str],
                   cores: int | None = None) -> dict[str, int]:
    """Torch threads per worker name: ``config.threads_per_worker``, or the host's cores divided
    among the workers ``host_of`` places on that host (at least one each). More threads than cores
    make the workers of a host spin against each other, so the default never oversubscribes."""
    names = [w.name for r in layout for w in r.workers]
    if config.threads_per_worker is not None:
        return {n: config.threads_per_worker for n in names}
    cores = cores or host_cores()
    per_host: dict[str, int] = {}
    for n in names:
        per_host[host_of(n)] = per_host.get(host_of(n), 0) + 1
    return {n: max(1, cores // per_host[host_of(n)]) for n in names}


def check_dtype(dtype: str, devices: set[str]) -> None:
    """Raise ``RuntimeFailure`` naming the device when one of ``devices`` ("cpu", "cuda:k") cannot
    compute in ``dtype``: a GPU before compute capability 8.0 has no bfloat16, and a CPU build of
    torch may lack a half-precision kernel the model needs. Checked before any worker starts, so
    the error is one line rather than a worker's traceback."""
    import torch

    if dtype == "float32":
        return
    for dev in sorted(devices):
        if dev.startswith("cuda") and dtype == "bfloat16" and not _cuda_bf16(torch, dev):
            raise RuntimeFailure(f"{dev} ({torch.cuda.get_device_name(dev)}) cannot run bfloat16 (compute "
                                 "capability 8.0 or later is needed): serve it in float16 or float32")
        if dev == "cpu":
            try:  # the ops of a layer: a linear, a softmax, a norm, silu
                x = torch.ones(2, 8, dtype=getattr(torch, dtype))
                y = torch.nn.functional.linear(x, torch.ones(8, 8, dtype=x.dtype)).softmax(-1)
                torch.nn.functional.silu(torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True)).to(x.dtype) * y)
            except RuntimeError as exc:
                raise RuntimeFailure(f"this CPU build of torch cannot compute in {dtype} ({exc}): "
                                     "serve it in float32") from exc


def _cuda_bf16(torch, dev: str) -> bool:
    return torch.cuda.get_device_capability(dev)[0] >= 8
