"""A request's choices and prompt scoring, as the runtime's engine serves them, for the replicas.

A request with ``n`` choices (OpenAI ``n``) is simulated as one unit that decodes ``n`` rows: its
choices are admitted, prefilled, decoded and finished together, each generating the request's
output tokens. What they hold and feed follows the engine (``EngineLoop._fork``):

* where the prompt is prefilled with a reservation (not paged KV), not scored, and not recomputed,
  the choices share the prompt's full blocks except the block of its last token (``shared``
  tokens): the first choice prefills the whole prompt, each other one only the rest (1 to a block
  of tokens, attending to the shared part) into blocks of its own;
* otherwise (paged KV, whose pre-emption counts a sequence's blocks as its own; prompt logprobs,
  which need every position's hidden state; a recompute) every choice prefills the whole prompt;
* a decode replica receives each choice's KV through its own hand-off: nothing is shared there.

A scored request (``prompt_logprobs``) returns the logprobs of every prompt position but the first,
for each choice: its prefill runs the LM head and log-softmax over those positions
(``CostModel.prompt_logprob_time``).

Simplification: the engine prefills the other choices' rests in the step after the first choice's
prefill; here they ride in the same step, so they join the decode batch one step early.
"""

from __future__ import annotations

from hetserve.cost.analytic import PrefillBatch
from hetserve.policies.batching import kv_reservation
from hetserve.sim.requests import RequestTable


def shared_tokens(r: RequestTable, rid: int, block_size: int, paged: bool) -> int:
    """Prompt tokens ``rid``'s choices hold once on the replica that prefills it (0: none shared)."""
    if r.choices[rid] == 1 or paged or r.scored[rid] or r.made[rid]:
        return 0
    return (r.inp[rid] - 1) // block_size * block_size


def fed_tokens(r: RequestTable, rid: int, shared: int) -> int:
    """Tokens ``rid``'s prefill feeds, all choices together: prompt (and, recomputed, what it had
    made) for the first, less the shared part for each other."""
    per = r.inp[rid] + r.made[rid]
    return per + (r.choices[rid] - 1) * (per - shared)


def prefill_batch(r: RequestTable, rids, shared_of) -> PrefillBatch:
    """The prefill of ``rids`` (each with all its choices) as one batch; ``shared_of(rid)``: its
    shared tokens. A choice's rest of ``c`` tokens attends to the ``shared`` before it."""
    seqs = tokens = scored = 0
    sum_sq = 0.0
    for rid in rids:
        n, per, s = r.choices[rid], r.inp[rid] + r.made[rid], shared_of(rid)
        rest = per - s
        seqs += n
        tokens += per + (n - 1) * rest
        sum_sq += per * per + (n - 1) * (rest * rest + 2.0 * rest * s)
        if r.scored[rid]:
            scored += n * (r.inp[rid] - 1)
    return PrefillBatch(seqs, tokens, sum_sq, scored)


def reservation(r: RequestTable, rid: int, decoding: bool, block_size: int, shared: int) -> int:
    """KV tokens ``rid``'s choices reserve together (whole blocks): each its own, the shared part once."""
    own = (kv_reservation(r.inp[rid], r.out[rid], True, block_size) if decoding else
           kv_reservation(r.inp[rid] + r.made[rid], 0, False, block_size))
    return r.choices[rid] * own - (r.choices[rid] - 1) * shared
