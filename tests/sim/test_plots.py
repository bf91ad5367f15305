"""A latency plot's title says where its figures come from: simulated, priced as the cost model
priced each GPU type (or as the caller's source says, a calibration's)."""

from matplotlib.figure import Figure

from hetserve.sim import simulate
from hetserve.sim.plots import plot_latency_cdfs
from hetserve.specs.workload import Workload

from .plans import single


def test_the_cdf_title_names_the_pricing(cluster, model, tmp_path, monkeypatch):
    titles = []
    real = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, t, **kw: titles.append(t) or real(self, t, **kw))
    res = simulate(single({"c0": ["m0:0"]}), cluster, model, Workload.from_lists("t", [0.0, 1.0], [50, 60], [5, 6]))
    plot_latency_cdfs({"simulated": res}, tmp_path / "a.png")
    assert titles[0].startswith("simulated latency"), titles
    assert set(res.info["pricing"]) <= set(titles[0].replace("\n", " ").replace(",", " ").replace(":", " ").split())
    res.save(tmp_path / "out", summary={**res.summary(), "timings": {"source": "cost model calibrated by c.json"}})
    assert "times from the cost model calibrated by c.json" in titles[1].replace("\n", " ")
