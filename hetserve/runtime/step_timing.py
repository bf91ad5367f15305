"""``StepTiming``: one engine step as the coordinator saw it, from sending it to handling its result.

``hetserve compare`` records these on the served side and sets them beside the simulator's steps for
the same requests (``hetserve.calibration.step_compare``): when served and simulated latencies differ, the step
times say whether the cost model's step is off or the time goes between steps (queueing, the front
end). The span includes what a step costs the coordinator on its critical path: the message to the
first stage, the stages, the result back and the coordinator's turn to read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTiming:
    replica: str
    started: float  # time.monotonic() when the coordinator sent the step
    decode_ids: tuple[int, ...]  # the running sequences decoding one token each
    decode_context: int  # tokens of context those sequences attend to (their KV after this step)
    prompt_tokens: tuple[int, ...]  # per prompt (or chunk) in the step, its tokens
    finished: float = 0.0  # when the coordinator handled its result
    # the stage leaders' own time on it, summed over the stages (wall; CPU of their step threads):
    # the span less ``worker_s`` is the transport and the front end (its GIL), the wall less the CPU
    # the worker waiting for a core
    worker_s: float = float("nan")
    worker_cpu_s: float = float("nan")

    @property
    def seconds(self) -> float:
        return self.finished - self.started
