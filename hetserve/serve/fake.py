"""An in-process fake engine and a byte-level codec, for tests of the HTTP front.

``FakeBackend`` follows ``hetserve.serve.backend.Backend``: replicas with a fixed number of slots
(a request holds one from admission to its end, like a KV reservation), deterministic tokens, and
an abort that frees the slot at once. No processes, no torch.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from hetserve.policies.base import ReplicaState
from hetserve.runtime.params import SamplingParams
from hetserve.serve.backend import SampledToken

EOS = 257


class ByteCodec:
    """Token id b < 256 is byte b; 257 is <eos> (as make_model's tokenizer)."""

    eos_token_id = EOS
    max_token_chars = 1  # a token is one byte, so never more than one character

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if token < 256 else b""

    def render_chat(self, messages) -> str:
        return "".join(f"{r}: {t}\n" for r, t in messages) + "assistant:"


def fake_logprob(position: int) -> float:
    """The logprob the fake reports for whatever token sits at ``position`` of the sequence."""
    return -0.5 - position / 100


def fake_top(token: int, position: int, k: int) -> list[tuple[int, float]]:
    """``k`` alternatives: ``token`` first, then the next letters, each one nat less likely."""
    return [(token if j == 0 else ord("a") + (token + j) % 26, fake_logprob(position) - j) for j in range(k)]


class FakeBackend:
    """Replicas of ``slots`` concurrent requests each; token k of a request is the letter
    ``(seed + k) % 26`` (seed: the params' seed, else the prompt's byte sum); ``eos_at`` makes the
    request end with <eos> as its token number ``eos_at``. Asked for logprobs, the token at position
    p of the sequence has ``fake_logprob(p)`` and alternatives ``fake_top``."""

    def __init__(self, replicas: int = 2, slots: int = 64, token_delay_s: float = 0.002,
                 max_context: int = 256, kv_capacity: int = 100_000, eos_at: int | None = None):
        self.max_context, self.vocab_size, self.block_size = max_context, 259, 16
        self.channels: dict[str, dict[str, int]] = {}  # worker -> device-channel counts, as tests set them
        self.token_delay_s, self.eos_at = token_delay_s, eos_at
        self.kv_capacity = kv_capacity
        self.slots = {f"r{i}": slots for i in range(replicas)}
        self.running: dict[str, str] = {}  # request -> replica
        self.waiting: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.finished: set[str] = set()
        self.placed: list[str | None] = []
        self.params: dict[str, SamplingParams] = {}  # what each request asked the engine for
        self.failure: str | None = None
        self.dead: set[str] = set()  # replicas reported down
        self.refused: dict[str, int] = {}  # what the runtime's endpoints would have refused, by reason

    def _free(self, replica: str) -> int:
        return self.slots[replica] - sum(1 for r in self.running.values() if r == replica)

    async def generate(self, request_id: str, prompt_token_ids, params: SamplingParams, replica=None, *,
                       share_with: str | None = None):
        replica = replica or "r0"
        self.placed.append(replica)
        self.params[request_id] = params
        seed = params.seed if params.seed is not None else sum(prompt_token_ids)
        self.waiting[request_id] = replica
        try:
            while request_id not in self.aborted and self._free(replica) <= 0:
                await asyncio.sleep(0.002)  # a slot frees when a running request ends or is aborted
            self.waiting.pop(request_id, None)
            if request_id in self.aborted:
                return
            self.running[request_id] = replica
            for k in range(params.max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if request_id in self.aborted:
                    return
                if self.failure is not None:
                    raise RuntimeError(self.failure)
                if self.eos_at is not None and k + 1 == self.eos_at and EOS in params.stop_token_ids:
                    yield EOS
                    return
                token = ord("a") + (seed + k) % 26
                if params.logprobs is None and params.prompt_logprobs is None:
                    yield token
                    continue
                pos, n = len(prompt_token_ids) + k, len(prompt_token_ids)
                plp = None
                if k == 0 and params.prompt_logprobs is not None:
                    plp = [(fake_logprob(i), fake_top(prompt_token_ids[i], i, params.prompt_logprobs))
                           for i in range(1, n)]
                yield SampledToken(token, fake_logprob(pos), fake_top(token, pos, params.logprobs or 0), plp)
            self.finished.add(request_id)
        finally:
            self.waiting.pop(request_id, None)
            self.running.pop(request_id, None)

    def fail_all(self, reason: str) -> None:
        self.failure = reason  # every running generator raises it at its next token

    def abort(self, request_id: str) -> None:
        if request_id not in self.finished:
            self.aborted.add(request_id)
        self.running.pop(request_id, None)

    def replicas(self) -> list[ReplicaState]:
        out = []
        for rid in self.slots:
            run = [r for r, rep in self.running.items() if rep == rid]
            wait = [r for r, rep in self.waiting.items() if rep == rid]
            out.append(ReplicaState(id=rid, role="colocated", queued_requests=len(wait),
                                    running_requests=len(run), queued_prefill_tokens=0,
                                    outstanding_tokens=float(len(run) + len(wait)), context_tokens=0,
                                    kv_used_tokens=len(run), kv_capacity_tokens=self.kv_capacity,
                                    alive=rid not in self.dead))
        return out

    def link_stats(self):
        from hetserve.runtime.links.network import LinkStats

        s = LinkStats("m0:0", "m0:1", 0.03, 12.5e6)
        s.bytes_sent["decode"] = 1024.0
        return [s]

    def refused_connections(self) -> dict[str, int]:
        return dict(self.refused)

    def channel_stats(self) -> dict[str, dict[str, int]]:
        return {w: dict(c) for w, c in self.channels.items()}

    async def close(self) -> None:
        pass
