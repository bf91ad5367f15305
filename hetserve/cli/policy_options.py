"""The request-policy options ``simulate``, ``serve`` and ``compare`` share: one name and one default each.

Choices come from the policies' own registries (a bad name is refused by argparse in one line, exit
code 2, before any work starts) and defaults from the policies' modules, so the simulator and the
server decide the same way when nothing is named.
"""

from __future__ import annotations

import argparse

from hetserve.policies.placement import DEFAULT_PLACEMENT, placement_names
from hetserve.policies.routing import DEFAULT_ROUTE, route_names
from hetserve.policies.transmission import DEFAULT_TRANSMISSION, transmission_names


def add_policy_options(p: argparse.ArgumentParser, *, transmission: bool = True, both_sides: bool = False) -> None:
    """``--placement`` (``--router`` is its other spelling), ``--route`` and, with ``transmission``,
    ``--transmission`` (``--route`` and ``--transmission`` default to None, read as ``DEFAULT_ROUTE`` /
    ``DEFAULT_TRANSMISSION``: a command may refuse an explicit choice that cannot act, see
    ``sim/option_checks.py``)."""
    sides = ", both sides" if both_sides else ""
    p.add_argument("--placement", "--router", dest="placement", default=DEFAULT_PLACEMENT, choices=placement_names(),
                   action=_OnePlacement,
                   help=f"request placement{sides}: %(choices)s (default {DEFAULT_PLACEMENT}: least expected finish "
                        "time, by each replica's planned speed)")
    p.add_argument("--route", choices=route_names(),
                   help=f"KV route policy for prefill -> decode hand-offs{sides}: %(choices)s "
                        f"(default {DEFAULT_ROUTE}: the plan's weights)")
    if transmission:
        p.add_argument("--transmission", choices=transmission_names(),
                       help=f"link scheduling: %(choices)s (default {DEFAULT_TRANSMISSION})")


class _OnePlacement(argparse.Action):
    """Stores the placement, refusing a second, different one (``--placement rr --router jsq``):
    argparse would keep the last without a word. The same value under both spellings is one."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = getattr(namespace, "_placement_given", None)
        if first is not None and first[1] != values:
            parser.error(f"{option_string}: expected one placement (--router is --placement's other spelling); "
                         f"drop one, got '{first[0]} {first[1]} and {option_string} {values}'")
        namespace._placement_given = (option_string, values)
        setattr(namespace, self.dest, values)


def placement_given(args: argparse.Namespace) -> bool:
    """Whether the command line named a placement (``--placement`` or ``--router``)."""
    return getattr(args, "_placement_given", None) is not None


def transmission_of(args: argparse.Namespace) -> str:
    """The link scheduling ``args`` name, or the default."""
    return args.transmission or DEFAULT_TRANSMISSION


def route_of(args: argparse.Namespace) -> str:
    """The KV route policy ``args`` name, or the default."""
    return args.route or DEFAULT_ROUTE
