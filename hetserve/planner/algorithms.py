"""The planning algorithms by name (the package docstring lists them; ``planner.plan`` runs one)."""

from __future__ import annotations

from typing import Callable

from hetserve.planner.plan import Plan
from hetserve.planner.search.baselines import genetic, uniform
from hetserve.planner.search.exact import exact, exact_colocated
from hetserve.planner.search.hexgen import hexgen
from hetserve.planner.search.hexgen2 import hexgen2, random_swap

Algorithm = Callable[..., Plan]

ALGORITHMS: dict[str, Algorithm] = {
    "hexgen2": hexgen2,
    "random-swap": random_swap,
    "genetic": genetic,
    "uniform": uniform,
    "hexgen": hexgen,
    "exact": exact,
    "exact-colocated": exact_colocated,
}
