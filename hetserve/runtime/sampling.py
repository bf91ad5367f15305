"""Sampling parameters and the sampler run by the last stage's leader.

Sampling is keyed, not stateful: token ``i`` of a request is drawn with a generator seeded from
``(seed, i)``. The same seed therefore gives the same tokens whichever replica, batch or process
produces each token (a disaggregated request samples its first token on the prefill replica and
the rest on a decode replica). ``temperature == 0`` is greedy (argmax, as transformers' greedy
search).
"""

from __future__ import annotations

import torch



# what travels with a step for each sequence: (temperature, top_p, seed, token index)
SampleKey = tuple[float, float, int, int]


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2 ** 63 - 1))


def sample(logits: torch.Tensor, keys: list[SampleKey]) -> torch.Tensor:
    """One token per row of ``logits`` (B, V). Returns (B,) long on CPU."""
    tokens = logits.argmax(dim=-1).cpu()  # (B,)
    for b, (temperature, top_p, seed, index) in enumerate(keys):
        if temperature == 0:
            continue
        probs = torch.softmax(logits[b].float().cpu() / temperature, dim=-1)  # (V,)
        if top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < top_p  # smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        tokens[b] = torch.multinomial(probs, 1, generator=_generator(seed, index))[0]
    return tokens
