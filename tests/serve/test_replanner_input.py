"""A re-plan refused for bad input changes nothing: the next re-plan does not inherit its devices."""

from __future__ import annotations

import pytest

from hetserve.errors import HetserveError
from hetserve.serve.replan import Replanner
from hetserve.specs.cluster import load_cluster


class _Engine:
    cluster = load_cluster("demo-tiny")

    def stats(self):
        return {"deaths": [], "replicas": {}}


def test_a_refused_replan_leaves_the_lost_devices_as_they_were():
    r = Replanner(_Engine())
    r.lost = {"m0:1"}
    with pytest.raises(HetserveError, match="zz:9"):
        r.replan(lost=["zz:9"])
    assert r.lost == {"m0:1"}
    with pytest.raises(HetserveError, match="zz:9"):
        r.replan(returned=["m0:1", "zz:9"])
    assert r.lost == {"m0:1"}


def test_a_replan_that_means_nothing_is_refused():
    """Returning a device that is not lost, or naming one both lost and returned, changes nothing and
    says so (it was answered 200, re-planning for nothing)."""
    r = Replanner(_Engine())
    r.lost = {"m0:1"}
    with pytest.raises(HetserveError, match=r"returned devices \['m0:0'\] are not lost \(lost now: \['m0:1'\]\)"):
        r.replan(returned=["m0:0"])
    with pytest.raises(HetserveError, match=r"devices \['m1:0'\] are named both lost and returned"):
        r.replan(lost=["m1:0"], returned=["m1:0"])
    assert r.lost == {"m0:1"}
