"""Session-wide test settings."""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _keep_every_group_bound():
    """Many tests plan the same presets (het1, het2, het3 with llama-2-70b on azure-conv) and so price
    the same group bound, a MILP of up to a minute. ``bound``'s cache keeps 64 of them, first in first
    out, and the budgeted bounds of min_cost's bisections in between pushed the presets' bounds out,
    so each was solved three times in a run. Keep every bound for the session: a cached one is what
    the same code computed for the same inputs (the key is everything the bound reads)."""
    from hetserve.planner import bound

    saved = bound._CACHE_SIZE
    bound._CACHE_SIZE = 100_000
    yield
    bound._CACHE_SIZE = saved
