"""What every number on the command line must be, in one table, applied to every command's options.

A numeric option (``type=int`` / ``type=float``) must be finite and positive unless ``BOUNDS``
names its own range; argparse then refuses a bad value with one line naming the option and the
range, exit code 2, before the command does any work (``--port 70000`` is refused before workers
start, ``--slo-ttft nan`` is never silently accepted).
"""

from __future__ import annotations

import argparse
import math

from hetserve.errors import SpecError

# option dest -> (low, high, low inclusive, high inclusive); None: unbounded on that side
BOUNDS: dict[str, tuple[float | None, float | None, bool, bool]] = {
    "seed": (0, 2 ** 63 - 1, True, True),
    "port": (0, 65535, True, True),  # 0: the OS picks a free port
    "gamma": (0, 1, True, True),
    "theta": (0, 1, False, True),
    "target": (0, 1, False, False),
    "drain_timeout": (0, None, True, False),
    "health_interval": (0, None, True, False),  # route: 0 = no health checks
    "speed_weight": (0, 1, True, True),  # compare: the power of the speed probe's ratio
    # plan's flow period T: under a millisecond no request fits it, past a day the per-period
    # counts lose their meaning (and 1e300 s overflows the rates derived from it)
    "period": (1e-3, 86400, True, True),
}
POSITIVE = (0, None, False, False)


def _describe(kind: type, low, high, lo_in: bool, hi_in: bool) -> str:
    what = "an integer" if kind is int else "a finite number"

    def num(x) -> str:  # an integer option's bounds in full: 9223372036854775807, not 9.22337e+18
        return str(int(x)) if kind is int and float(x).is_integer() else f"{x:g}"

    if low is not None and high is None:
        return f"{what} {'>=' if lo_in else '>'} {num(low)}"
    return f"{what} in {'[' if lo_in else '('}{num(low)}, {num(high)}{']' if hi_in else ')'}"


def checked(kind: type, dest: str):
    """An argparse ``type`` that parses ``kind`` and enforces the bounds of ``dest``."""
    low, high, lo_in, hi_in = BOUNDS.get(dest, POSITIVE)
    expected = _describe(kind, low, high, lo_in, hi_in)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        ok = math.isfinite(value)
        ok = ok and (low is None or (value >= low if lo_in else value > low))
        ok = ok and (high is None or (value <= high if hi_in else value < high))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def apply_bounds(parser: argparse.ArgumentParser) -> None:
    """Replace every int/float option type of ``parser`` and its subcommands with a checked one."""
    for action in parser._actions:  # noqa: SLF001 - argparse exposes no public walk
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in set(action.choices.values()):
                apply_bounds(sub)
        elif action.type in (int, float):
            action.type = checked(action.type, action.dest)


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (``hetserve serve: error: argument --port: ...``), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def check_micro_batches(value: int | None, plan, plan_path: str) -> None:
    """``--micro-batches`` is at most 2N for the plan's deepest pipeline of N stages: MoLink §4.3
    searches N..2N (``choose_micro_batches``); more steps in flight than that only queue."""
    if value is None:
        return
    deepest = max((len(r.stages) for r in plan.replicas), default=1)
    if not 1 <= value <= 2 * deepest:
        raise SpecError("--micro-batches", SpecError.OPTION, f"an integer in [1, {2 * deepest}] (twice the "
                        f"{deepest} stages of {plan_path}'s deepest pipeline, MoLink's N..2N)", value)
