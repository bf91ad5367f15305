"""A re-plan refused for bad input changes nothing: the next re-plan does not inherit its devices."""

from __future__ import annotations

import os

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


def test_a_requested_cluster_file_is_refused_without_its_contents(tmp_path):
    """The cluster path comes from an HTTP request: a file that is no cluster is refused naming the
    field, never the value the server read there; a device or a FIFO is never read (``/dev/zero``
    would be read until memory ran out, a FIFO would block the re-plan forever)."""
    r = Replanner(_Engine())
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text("db_password: hunter2\n")
    with pytest.raises(HetserveError, match="db_password") as refused:
        r.replan(cluster=str(secrets))
    assert "hunter2" not in str(refused.value)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(HetserveError, match="expected a regular file"):
            r.replan(cluster=path)
    assert not r.lost
