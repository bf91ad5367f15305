"""The sampler run by the last stage's leader: a pure function of (logits, per-request keys, each
sequence's token history), so it can run wherever the step's logits are. It runs on the logits'
device, batched over rows, and copies one (B,) tensor of tokens to the host.

Sampling is keyed, not stateful: token ``i`` of a request is drawn from noise that is a function of
``(seed, i)`` alone. The same seed therefore gives the same tokens whichever replica, batch or
process produces each token (a disaggregated request samples its first token on the prefill replica
and the rest on a decode replica). ``temperature == 0`` is greedy (argmax, as transformers' greedy
search).

The draw is an exponential race: with ``E_v ~ Exp(1)`` independent per vocabulary id ``v``,
``argmax_v p_v / E_v`` is distributed as ``p`` (the Gumbel-max trick in another form), so it needs
no cumulative sum and no host round trip. ``E`` comes from a counter-based hash of
``(seed, i, v)`` in 32-bit integer arithmetic, so it is the same on every device and for every
batch, and a row's noise never depends on its batch-mates.

Penalties (applied to the row's logits before temperature, greedy included, in vLLM's order):

- ``repetition_penalty`` r (vLLM's, from CTRL): each token seen in the prompt or the output so far
  has its logit divided by r when positive, multiplied by r when negative;
- ``frequency_penalty`` f (OpenAI): logit -= f × (times the token appears in the output so far);
- ``presence_penalty`` p (OpenAI): logit -= p × (1 if it appears in the output so far).

Logprobs (``token_logprobs``) are those of the model's raw distribution, ``log_softmax(logits)``
before penalties, temperature and top-p, as vLLM returns them by default: what a scorer compares
with the model's likelihood, whatever the sampling settings.
"""

from __future__ import annotations

import torch

# what travels with a step for each sequence:
# (temperature, top_p, seed, token index, presence, frequency, repetition, logprobs)
# ``logprobs``: -1 none, k >= 0 the sampled token's logprob and the k most likely alternatives.
# Keys of only the first four fields are read with the neutral defaults for the rest.
SampleKey = tuple
NEUTRAL = (0.0, 0.0, 1.0, -1)  # presence, frequency, repetition, logprobs
# ``History``: (ids seen in the prompt, output ids so far), sent only for a penalised sequence
History = tuple

_MASK32 = 0xFFFFFFFF
_MIX = 0x045D9F3B  # < 2**27: a product with a 32-bit value stays inside int64 on every device


def _fields(key) -> tuple:
    key = tuple(key)
    return key + NEUTRAL[len(key) - 4:] if len(key) < 8 else key


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values in [0, 2**32) held in int64; no op overflows)."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seeds: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, vocab) float32 of Exp(1) draws, a pure function of each row's (seed, token index) and
    the column. ``seeds``, ``indices``: (N,) int64 on the device the noise is made on."""
    row = _mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32 & _MASK32) ^ _mix32(indices & _MASK32))  # (N,)
    col = torch.arange(vocab, device=seeds.device, dtype=torch.int64)  # (V,)
    bits = _mix32(_mix32(row[:, None] ^ col[None, :]) ^ row[:, None])  # (N, V)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (N, V) uniform in (0, 1)
    return -torch.log(u)


def penalize(row: torch.Tensor, history: History | None, presence: float, frequency: float,
             repetition: float) -> torch.Tensor:
    """``row`` (V,) float with the three penalties applied from ``history`` (a new tensor)."""
    if history is None or (presence == 0 and frequency == 0 and repetition == 1):
        return row
    return _penalize_rows(row[None], [history], [(presence, frequency, repetition)])[0]


def _penalize_rows(rows: torch.Tensor, histories: list[History | None], pens: list[tuple]) -> torch.Tensor:
    """``rows`` (N, V) with each row's (presence, frequency, repetition) applied from its history, on
    the rows' device: one host->device copy of the padded histories."""
    N, V = rows.shape
    outputs = [list(h[1]) if h else [] for h in histories]
    prompts = [list(h[0]) if h else [] for h in histories]
    width_o, width_p = max(1, max(map(len, outputs))), max(1, max(map(len, prompts)))
    ids = torch.full((N, width_o + width_p), V, dtype=torch.long)  # V: a padding column, dropped
    for n, (o, p) in enumerate(zip(outputs, prompts)):
        ids[n, :len(o)] = torch.tensor(o, dtype=torch.long)
        ids[n, width_o:width_o + len(p)] = torch.tensor(p, dtype=torch.long)
    pen = torch.tensor(pens, dtype=rows.dtype)  # (N, 3) presence, frequency, repetition
    ids, pen = ids.to(rows.device, non_blocking=True), pen.to(rows.device, non_blocking=True)
    counts = rows.new_zeros(N, V + 1).scatter_add_(1, ids[:, :width_o], rows.new_ones(N, width_o))[:, :V]
    in_prompt = rows.new_zeros(N, V + 1).scatter_(1, ids[:, width_o:], 1.0)[:, :V] > 0
    presence, frequency, repetition = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]  # (N, 1)
    seen = (counts > 0) | in_prompt
    rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
    return rows - frequency * counts - presence * (counts > 0).to(rows.dtype)


def sample_on_device(logits: torch.Tensor, keys: list[SampleKey],
                     histories: list[History | None] | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V), on the logits' device: (B,) long, never read back
    here (the caller copies it to the host once)."""
    fields = [_fields(k) for k in keys]
    histories = histories if histories is not None else [None] * len(keys)
    penalized = [h is not None and (f[4] != 0 or f[5] != 0 or f[6] != 1) for f, h in zip(fields, histories)]
    sampled = [f[0] != 0 for f in fields]
    if not any(penalized) and not any(sampled):
        return logits.argmax(dim=-1)  # (B,)
    rows = logits.float()
    if any(penalized):
        rows = _penalize_rows(rows, [h if p else None for h, p in zip(histories, penalized)],
                              [f[4:7] if p else NEUTRAL[:3] for f, p in zip(fields, penalized)])
    greedy = rows.argmax(dim=-1)  # (B,)
    if not any(sampled):
        return greedy
    params = torch.tensor([(f[0] if f[0] != 0 else 1.0, f[1], float(s)) for f, s in zip(fields, sampled)],
                          dtype=torch.float32)  # (B, 3) temperature, top_p, sampled?
    seeds = torch.tensor([[int(f[2]) % (1 << 63), int(f[3]) % (1 << 63)] for f in fields], dtype=torch.int64)  # (B, 2)
    params = params.to(rows.device, non_blocking=True)
    seeds = seeds.to(rows.device, non_blocking=True)
    probs = torch.softmax(rows / params[:, 0:1], dim=-1)  # (B, V)
    if any(f[1] < 1.0 for f, s in zip(fields, sampled) if s):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < params[:, 1:2]  # smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    race = (probs / exponential_noise(seeds[:, 0], seeds[:, 1], rows.shape[1])).argmax(dim=-1)  # (B,)
    return torch.where(params[:, 2] > 0, race, greedy)


def sample(logits: torch.Tensor, keys: list[SampleKey], histories: list[History | None] | None = None
           ) -> torch.Tensor:
    """One token per row of ``logits`` (B, V). Returns (B,) long on CPU (one device->host copy)."""
    return sample_on_device(logits, keys, histories).cpu()


def wants_logprobs(keys: list[SampleKey]) -> int:
    """The most alternatives any row asks for (-1: no row asks for logprobs)."""
    return max((int(_fields(k)[7]) for k in keys), default=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of ``logits`` (N, V): the logprob of ``tokens`` (N,) under ``log_softmax`` of the
    raw logits (float32), and the ``k`` most likely tokens with theirs. Returns (N,) float32, (N, k)
    long, (N, k) float32, all on CPU."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = lp.gather(1, tokens.to(lp.device).long().view(-1, 1)).view(-1)  # (N,)
    top_lps, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())  # (N, k)
    return chosen.cpu(), top_ids.cpu(), top_lps.cpu()
