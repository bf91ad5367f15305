"""What the optional compiled build of the simulator (``make fast-sim``: mypyc, a copy of the
package in ``.fast-sim/``) needs said in the source.

``mypyc_attr(allow_interpreted_subclasses=True)`` marks the policy classes that users and tests
subclass: compiled, a class refuses interpreted subclasses unless told. In the plain install,
where mypy is absent, the decorator changes nothing."""

from __future__ import annotations

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # nothing is compiled: nothing to allow
    def mypyc_attr(*args: object, **kwargs: object):  # type: ignore[no-redef]
        return lambda cls: cls

__all__ = ["mypyc_attr"]
