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

