"""Which replica shapes an engine can run, as the per-replica layout search sees them.

A shape here is a TP split per device class (``LayoutSearch`` builds each TP group inside one
class: one machine, one GPU type) in pipeline order. The rules are read from each engine's source
(the versions are named in ``hetserve.export.rules``, which checks whole plans the same way):

* ``hetserve``: every shape (asymmetric TP and layers per stage).
* ``vllm``: one ``--tensor-parallel-size`` per replica (``ParallelConfig``: world size = TP × PP),
  any layers per stage (``VLLM_PP_LAYER_PARTITION``); a decode replica is unpipelined, because
  the KV connector pairs prefill and decode workers by TP rank only.
* ``sglang``: one ``--tp-size`` per replica; a replica over n machines runs ``pp_size // n``
  consecutive stages on each (``engine.py``'s rank ranges), so every class in use holds the same
  number of stages.
"""

from __future__ import annotations

from typing import Sequence

ENGINES = ("hetserve", "vllm", "sglang")


def shape_allowed(engine: str, role: str, combo: Sequence[Sequence[int]]) -> bool:
    """Can ``engine`` run a replica of ``role`` whose class ``i`` is cut into TP groups ``combo[i]``?"""
    if engine == "hetserve":
        return True
    tps = [t for split in combo for t in split]
    if len(set(tps)) > 1:
        return False
    if engine == "vllm":
        return role != "decode" or len(tps) == 1
    if engine == "sglang":
        return len({len(split) for split in combo if split}) <= 1
    raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
