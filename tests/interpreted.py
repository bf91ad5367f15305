"""Tests that need a class to be interpreted, skipped only against the compiled copy.

``make test-fast-sim`` runs the sim, policies and cost tests with ``.fast-sim/`` first on the path,
where mypyc has made the simulator's classes native: a native class takes no patched method (its
compiled callers call the original directly) and no interpreted subclass. A test that spies on or
subclasses one cannot observe anything there; ``make test`` (CI) runs it on the very same source,
and ``bench_sim --compiled`` checks the compiled copy simulates the same thing (equal digests).
"""

from __future__ import annotations

from types import ModuleType

import pytest


def only_interpreted(module: ModuleType, needs: str) -> pytest.MarkDecorator:
    """Skip where ``module`` is compiled (its file is not a ``.py``): the test ``needs`` (e.g. "patches
    ``PipelineReplica._timing``") what a native class refuses."""
    return pytest.mark.skipif(not module.__file__.endswith(".py"),
                              reason=f"{module.__name__} is compiled here (make test-fast-sim) and the test {needs}, "
                                     "which a native class refuses; make test runs it on the same source")
