"""The max-min water fillings of one simulated network's components, cached (``sim.links``).

A component's rates depend only on its flow classes (each path's resources and its number of
flows, in order of first appearance, as ``cost.network.max_min_rates`` orders them) and on the
resources' capacities. ``Fillings.rate_of`` looks a component up by its paths' names and counts;
a miss looks it up again with each resource renamed by its first appearance (the order
``cost.network.capacities`` visits them) beside the capacities, so a component shaped like one seen
on other machines (a tiled fleet) reuses that filling: the same floats, as ``class_rates`` reads
names only to tell resources apart.
"""

from __future__ import annotations

from typing import Any, Callable

from hetserve.cost.network import class_rates, one_class_rate
from hetserve.specs.network import Path

_MAX = 1 << 16  # entries kept per table (a component's few shapes recur)


def _bounded(memo: dict, key):
    """``key``, with ``memo`` started afresh once it holds ``_MAX`` entries."""
    if len(memo) >= _MAX:
        memo.clear()
    return key


class Fillings:
    """Cached ``class_rates`` of one network (one ``competing_penalty``)."""

    def __init__(self, competing_penalty: float = 0.0):
        self.competing_penalty = competing_penalty
        self._by_names: dict[tuple, dict[tuple, float]] = {}  # (paths, counts) -> rate by path
        # paths -> (the number of their shape, their resources renamed, capacities): a shape is
        # looked up by its number, not by hashing its capacities' floats at every miss above
        self._renamed: dict[tuple, tuple[int, tuple, tuple]] = {}
        self._shape_numbers: dict[tuple, int] = {}  # (renamed paths, capacities) -> its number
        self._shapes = 0  # numbers given so far (never given twice: old ones stay right in ``_by_shape``)
        self._by_shape: dict[tuple[int, tuple], list[float]] = {}  # (shape's number, counts) -> rate per path
        self._narrowest: dict[tuple, float | None] = {}  # path -> its narrowest capacity (None: a resource twice)

    def alone(self, path: Path, flows: int) -> float | None:
        """Max-min rate of ``flows`` flows on ``path`` with nothing else on its resources, worked
        out at once (``one_class_rate``); None where the path crosses a resource twice."""
        names = path.names
        narrowest = self._narrowest.get(names, False)
        if narrowest is False:
            narrowest = self._narrowest[names] = path.bandwidth if len(set(names)) == len(names) else None
        return None if narrowest is None else one_class_rate(narrowest, flows, self.competing_penalty)

    def rate_of(self, counts: dict[tuple, int], resources: Callable[[Any], dict[tuple, tuple]],
                of: Any) -> dict[tuple, float]:
        """Max-min rate by path of ``counts`` (path's resource names -> its flows, in order of first
        appearance); ``resources(of)`` (asked on a miss only): each path's ``Resource`` objects."""
        sig = (tuple(counts), tuple(counts.values()))
        rate_of = self._by_names.get(sig)
        if rate_of is None:
            rate_of = self._by_names[_bounded(self._by_names, sig)] = dict(zip(sig[0], self._fill(*sig, resources, of)))
        return rate_of

    def _fill(self, members: tuple, count: tuple, resources: Callable[[Any], dict[tuple, tuple]],
              of: Any) -> list[float]:
        renamed = self._renamed.get(members)
        if renamed is None:
            path_of = resources(of)
            local: dict = {}
            caps: list = []
            classes: list = []
            for key in members:
                ids = []
                for k, r in zip(key, path_of[key]):
                    i = local.get(k)
                    if i is None:
                        i = local[k] = len(caps)
                        caps.append(r.bandwidth)
                    ids.append(i)
                classes.append(tuple(ids))
            full = (tuple(classes), tuple(caps))
            number = self._shape_numbers.get(full)
            if number is None:
                number = self._shape_numbers[_bounded(self._shape_numbers, full)] = self._shapes
                self._shapes += 1
            renamed = self._renamed[_bounded(self._renamed, members)] = (number, full[0], full[1])
        shape = (renamed[0], count)
        rate = self._by_shape.get(shape)
        if rate is None:
            rate = self._by_shape[_bounded(self._by_shape, shape)] = class_rates(
                renamed[1], count, dict(enumerate(renamed[2])), self.competing_penalty)
        return rate
