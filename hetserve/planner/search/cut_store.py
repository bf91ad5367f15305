"""Colocated cuts kept across evaluators and plan calls of the same planning problem.

``mixing._colocated_cut`` is memoised by class composition on each ``Evaluator``; every algorithm
(and every plan call) builds its own evaluator, and each recomputed the same cuts: on
hexgen-full-price most of HexGen-2's and random-swap's time. The cut of a composition is a pure
function of what ``problem_key`` fingerprints, so the store below keeps it for any evaluator of a
context with the same key.

What a cut reads (``mixing._colocated_cut_fresh``): the device classes and their memories
(``can_hold_weights``, ``split_devices``), and the colocated capacity of sub-compositions
(``LayoutSearch.capacity``): the cost model (devices with their GPU types, machines, sites and
CPU slots; the α/β matrices; the topology's NICs, pipes and links; the model; the efficiencies and
whether stages are priced by the kernel model or the roofline), the mean prompt and output
lengths, the period, the SLO targets (under SLO objectives) and the engine's allowed shapes; plus
the search constants of ``mixing`` and ``layout.search`` (tests patch some). A key missing one of
them would hand one problem another's cut, silently: add anything a cut comes to read.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict

import numpy as np

from hetserve.planner.layout import search as layout_search

MAX_PROBLEMS = 16  # problems whose cuts are kept (least recently used dropped past it)
MAX_CUTS_PER_PROBLEM = 4096  # cuts kept per problem (320 GPUs cut ~1,400); past it new ones stay on their evaluator

_STORE: OrderedDict[str, dict[tuple, list[tuple[int, ...]]]] = OrderedDict()
_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> (constants, ``problem_key``)
_LOCK = threading.Lock()  # plans may run in threads (a server's re-plan): the store's order is shared


def problem_key(ctx, constants: tuple = ()) -> str:
    """A digest of everything a colocated cut of ``ctx`` reads (module docstring); ``constants``:
    the caller's own search constants."""
    c = ctx.cluster
    h = hashlib.sha256()
    for part in (
        tuple(repr(d) for d in c.devices),  # index, name, machine, site, GPU type, memory, CPU slot
        repr(c.topology),
        repr(ctx.model),
        repr(ctx.cost.eff),
        tuple(sorted(ctx.cost.pricing().items())),  # kernel model or roofline, per GPU type
        repr((ctx.input_tokens, ctx.output_tokens, ctx.period_s)),
        repr(ctx.slo),
        repr(ctx.options.engine),
        repr((layout_search.MAX_SPLITS_PER_CLASS, layout_search.MAX_COMBOS, layout_search.PREFILL_KV_REQUESTS)),
        repr(constants),
    ):
        h.update(repr(part).encode())
        h.update(b"\0")
    for m in (c.latency, c.bandwidth):  # hashed in place: a 4,096-GPU matrix is 134 MB
        a = np.ascontiguousarray(m, dtype=float)
        h.update(repr(a.shape).encode())
        h.update(a.data)
    return h.hexdigest()


def shared_cuts(ctx, constants: tuple = ()) -> dict[tuple, list[tuple[int, ...]]]:
    """The cuts (composition -> device sets on each class's first devices) kept for ``ctx``'s
    problem: filled by whichever evaluator of the same problem cut a composition first."""
    key = _KEYS.get(ctx)
    if key is None or key[0] != constants:
        key = (constants, problem_key(ctx, constants))
        _KEYS[ctx] = key
    digest = key[1]
    with _LOCK:
        cuts = _STORE.get(digest)
        if cuts is None:
            if len(_STORE) >= MAX_PROBLEMS:
                _STORE.popitem(last=False)
            cuts = _STORE[digest] = {}
        else:
            _STORE.move_to_end(digest)
        return cuts


def keep(cuts: dict, comp: tuple, cut: list[tuple[int, ...]]) -> None:
    """Add a fresh cut to a problem's store (``shared_cuts``), within its size cap."""
    if len(cuts) < MAX_CUTS_PER_PROBLEM:
        cuts[comp] = cut


def clear() -> None:
    """Forget every kept cut (tests that count fresh cuts)."""
    with _LOCK:
        _STORE.clear()
        _KEYS.clear()
