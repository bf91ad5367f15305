"""The one error hierarchy of hetserve.

    HetserveError                 anything hetserve reports to a user (CLI prints one line, exit 2)
    ├── SpecError                 a cluster / model / workload input is malformed: names file, field, expectation
    ├── PlanError                 a plan file is malformed or inconsistent with its cluster / model
    ├── InfeasibleError           the request cannot be met at all (e.g. the model does not fit the pool)
    └── RuntimeFailure            the serving runtime could not start or lost a worker
        └── WorkerStartFailure    worker processes failed to start (``workers``: which)

Low-level exceptions (yaml, csv, json, OSError) are wrapped with ``raise ... from`` so the user sees
one clear line and the developer still has the chain.
"""

from __future__ import annotations


class HetserveError(Exception):
    """Base class for every error hetserve reports to a user."""


class SpecError(HetserveError, ValueError):
    """Malformed input file or value.

    ``source`` is the file (or preset name), ``field`` the dotted path inside it and
    ``expected`` what would have been accepted. An option's error (``source`` the option, ``field``
    ``OPTION``) names the option alone.
    """

    OPTION = "(option)"

    def __init__(self, source: str, field: str, expected: str, got: object = None):
        self.source, self.field, self.expected, self.got = source, field, expected, got
        where = "" if field == self.OPTION else f"field '{field}': "
        msg = f"{source}: {where}expected {expected}"
        if got is not None:
            msg += f", got {got!r}"
        super().__init__(msg)


class PlanError(HetserveError, ValueError):
    """A plan that is malformed or does not match its cluster or model."""


class InfeasibleError(HetserveError):
    """No deployment can satisfy the request (the message carries the numbers)."""


class RuntimeFailure(HetserveError, RuntimeError):
    """The serving runtime could not start, or a worker died."""


class WorkerStartFailure(RuntimeFailure):
    """Worker processes did not start (an error or exit while loading or connecting, or no word within
    the start-up timeout); ``workers``: their names, which are their devices' names."""

    def __init__(self, message: str, workers: tuple[str, ...] = ()):
        super().__init__(message)
        self.workers = tuple(workers)
