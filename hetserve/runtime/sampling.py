"""The sampler run by the last stage's leader: a pure function of (logits, per-request keys, each
sequence's token history), so it can run wherever the step's logits are.

Sampling is keyed, not stateful: token ``i`` of a request is drawn with a generator seeded from
``(seed, i)``. The same seed therefore gives the same tokens whichever replica, batch or process
produces each token (a disaggregated request samples its first token on the prefill replica and
the rest on a decode replica). ``temperature == 0`` is greedy (argmax, as transformers' greedy
search).

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


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2 ** 63 - 1))


def _fields(key) -> tuple:
    key = tuple(key)
    return key + NEUTRAL[len(key) - 4:] if len(key) < 8 else key


def penalize(row: torch.Tensor, history: History | None, presence: float, frequency: float,
             repetition: float) -> torch.Tensor:
    """``row`` (V,) float with the three penalties applied from ``history`` (a new tensor)."""
    if history is None or (presence == 0 and frequency == 0 and repetition == 1):
        return row
    seen_prompt, output = history
    V = row.shape[0]
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=V)[:V].to(row.dtype)  # (V,)
    row = row.clone()
    if repetition != 1:
        seen = counts > 0
        if seen_prompt:
            seen[torch.tensor(list(seen_prompt), dtype=torch.long)] = True
        row[seen] = torch.where(row[seen] > 0, row[seen] / repetition, row[seen] * repetition)
    return row - frequency * counts - presence * (counts > 0).to(row.dtype)


def sample(logits: torch.Tensor, keys: list[SampleKey], histories: list[History | None] | None = None
           ) -> torch.Tensor:
    """One token per row of ``logits`` (B, V). Returns (B,) long on CPU."""
    tokens = logits.argmax(dim=-1).cpu()  # (B,)
    for b, key in enumerate(keys):
        temperature, top_p, seed, index, presence, frequency, repetition, _ = _fields(key)
        history = histories[b] if histories is not None else None
        penalized = history is not None and (presence != 0 or frequency != 0 or repetition != 1)
        if temperature == 0 and not penalized:
            continue
        row = penalize(logits[b].float().cpu(), history, presence, frequency, repetition)  # (V,)
        if temperature == 0:
            tokens[b] = row.argmax()
            continue
        probs = torch.softmax(row / temperature, dim=-1)  # (V,)
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < top_p  # smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        tokens[b] = torch.multinomial(probs, 1, generator=_generator(seed, index))[0]
    return tokens


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
