"""The shapes a layout search returns: stages before devices are chosen, and the best choice."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageShape:
    """A stage before devices are chosen: ``tp`` devices of class ``cls`` holding ``layers``."""

    cls: int
    tp: int
    layers: tuple[int, int]


@dataclass(frozen=True)
class LayoutChoice:
    """The best layout of one composition in one role: capacity (requests per T) and shape."""

    capacity: float
    shapes: tuple[StageShape, ...]

    @property
    def num_stages(self) -> int:
        return len(self.shapes)



def remap(choice: LayoutChoice | None, classes: dict[int, int]) -> LayoutChoice | None:
    """``choice``'s shapes moved onto other classes (``classes``: old class → new class), for an
    isomorphic composition (``LayoutSearch._representative``)."""
    if choice is None:
        return None
    return LayoutChoice(choice.capacity, tuple(StageShape(classes[s.cls], s.tp, s.layers) for s in choice.shapes))
