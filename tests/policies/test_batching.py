"""``compose_step`` (``policies/batching.py``): the one rule the runtime's scheduler and the
simulator's replicas compose a step by."""

from __future__ import annotations

from collections import deque

from hetserve.policies.batching import Offer, compose_step


def _compose(prompts, fits=None, choices=None, **kw):
    """Compose over a queue of prompt lengths; ``fits``/``choices`` per prompt. Returns (step, taken, queue left)."""
    queue = deque(range(len(prompts)))
    taken = []
    fits = fits or [True] * len(prompts)
    choices = choices or [1] * len(prompts)

    def head():
        return Offer(prompts[queue[0]], fits[queue[0]], choices[queue[0]]) if queue else None

    step = compose_step(head, lambda: taken.append(queue.popleft()), **kw)
    return step, taken, list(queue)


def test_whole_prompts_ride_within_the_budget_first_come_first_served():
    step, taken, left = _compose([300, 500, 100], token_budget=1000, max_seqs=256, decodes=250, seqs=250)
    # 250 decode tokens + 300 + 500 = 1050 > 1000: the second stops admission, and nobody overtakes it
    assert taken == [0] and left == [1, 2] and step.chunks == (300,) and step.decodes == 250
    step, taken, _ = _compose([300, 500, 100], token_budget=1000, max_seqs=8, decodes=0, seqs=0)
    assert taken == [0, 1, 2] and step.prompt_tokens == 900 and step.admitted == 3


def test_the_first_prompt_of_a_step_gets_in_whatever_its_length():
    step, taken, _ = _compose([5000, 10], token_budget=1000, max_seqs=8, decodes=0, seqs=0)
    assert taken == [0] and step.chunks == (5000,)


def test_kv_that_does_not_fit_stops_admission():
    _, taken, left = _compose([10, 10, 10], fits=[True, False, True], token_budget=1000, max_seqs=8,
                              decodes=0, seqs=0)
    assert taken == [0] and left == [1, 2]


def test_the_sequence_limit_counts_every_choice_and_the_running_ones():
    # 4 running + a request of 3 choices = 7; the next (1 choice) makes 8 = the limit; the third does not fit
    _, taken, _ = _compose([10, 10, 10], choices=[3, 1, 1], token_budget=None, max_seqs=8, decodes=4, seqs=4)
    assert taken == [0, 1]


def test_a_step_that_preempted_admits_nothing():
    step, taken, _ = _compose([10], token_budget=1000, max_seqs=8, decodes=2, seqs=2, admit=False)
    assert taken == [] and step.chunks == () and step.decodes == 2


def test_chunked_prefill_feeds_older_prompts_first_up_to_the_chunk_budget():
    # 100 decodes leave 412 of 512 tokens: 300 left of an older prompt, then 112 of the first new one
    step, taken, _ = _compose([400, 50], token_budget=None, max_seqs=256, decodes=100, seqs=101,
                              chunk_tokens=512, prefilling=[300])
    assert taken == [0, 1] and step.chunks == (300, 112) and step.admitted == 2
    # beside a decode batch bigger than the chunk budget, a prompt still gets one token
    step, _, _ = _compose([400], token_budget=None, max_seqs=1000, decodes=600, seqs=600, chunk_tokens=512)
    assert step.chunks == (1,)
