"""Per-request inputs and timestamps of one simulation, as plain lists (fast to index from Python)."""

from __future__ import annotations

from hetserve.specs.workload import Workload


class RequestTable:
    """Row ``rid`` is request ``rid`` of the workload; timestamps are NaN until the event happens."""

    def __init__(self, wl: Workload):
        n = len(wl)
        self.n = n
        self.arrival: list[float] = wl.arrival_s.tolist()
        self.inp: list[int] = wl.input_tokens.tolist()
        self.out: list[int] = wl.output_tokens.tolist()  # per choice
        self.choices: list[int] = wl.choices.tolist()  # type: ignore[union-attr]  # choices decoded from the prompt (``sim.choices``)
        self.scored: list[bool] = wl.prompt_logprobs.tolist()  # type: ignore[union-attr]  # the prefill returns prompt logprobs
        self.pred: list[float] = [0.0] * n
        nan = float("nan")
        self.t_start = [nan] * n  # prefill began
        self.t_first = [nan] * n  # first token
        self.t_kv_start = [nan] * n
        self.t_kv_done = [nan] * n
        self.t_join = [nan] * n  # joined a decode batch
        self.t_finish = [nan] * n
        self.prefill_rep = [-1] * n
        # tokens a request had made when it was last pre-empted (paged KV; 0: never): its recompute
        # re-prefills prompt + these, and that prefill samples its next token
        self.made = [0] * n
        self.decode_rep = [-1] * n
        # why the request was rejected at arrival (``policies.request_checks`` reasons); "" = admitted
        self.rejected = [""] * n
