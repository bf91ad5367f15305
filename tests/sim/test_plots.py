"""A plot's title says where its figures come from: simulated, priced as the cost model priced each
GPU type (or as the caller's source says, a calibration's); every panel's axis reads in numbers."""

import numpy as np
from matplotlib.figure import Figure

from hetserve.sim import SimOptions, simulate
from hetserve.sim.plots import plot_latency_cdfs
from hetserve.sim.sweep import rate_sweep
from hetserve.specs.workload import SLO, Workload

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


def _drawn(monkeypatch) -> list:
    """The figures the plot functions save, drawn (their tick labels laid out) before they close."""
    figs = []
    real = Figure.savefig

    def keep(self, *a, **kw):
        self.canvas.draw()
        figs.append(self)
        return real(self, *a, **kw)
    monkeypatch.setattr(Figure, "savefig", keep)
    return figs


def _labels_in_view(ax) -> list[str]:
    lo, hi = ax.get_xlim()
    ticks = [(t, lab.get_text()) for t, lab in zip(ax.get_xticks(), ax.get_xticklabels())]
    ticks += [(t, lab.get_text()) for t, lab in zip(ax.get_xticks(minor=True), ax.get_xticklabels(minor=True))]
    return [text for t, text in ticks if lo <= t <= hi and text]


def test_every_cdf_panel_has_numbers_on_its_axis_when_it_spans_less_than_a_decade(cluster, model, tmp_path,
                                                                                     monkeypatch):
    """A panel whose figures lie between two decades (TPOT of 0.13-0.27 s) still reads in numbers."""
    figs = _drawn(monkeypatch)
    res = simulate(single({"c0": ["m0:0"]}), cluster, model,
                   Workload.from_lists("t", [0.0, 0.5, 1.0, 1.5], [50, 60, 70, 80], [5, 6, 1, 9]))
    res.t_finish[:] = res.t_first + np.array([0.13, 0.2, 0.0, 0.27]) * (res.output_tokens - 1)
    assert list(res.tpot) == [0.13, 0.2, 0.0, 0.27] or np.allclose(res.tpot, [0.13, 0.2, 0.0, 0.27])
    plot_latency_cdfs({"simulated": res}, tmp_path / "a.png")
    for ax in figs[0].axes:
        assert _labels_in_view(ax), ax.get_xlabel()
    # the one-token output has no TPOT: the curve has the three others only
    assert len(figs[0].axes[1].lines[0].get_xdata()) == 3


def test_a_sweep_without_an_slo_plots_the_completed_share_and_says_so(cluster, model, tmp_path, monkeypatch):
    figs = _drawn(monkeypatch)
    wl = Workload.from_lists("t", [0.0, 0.5, 1.0], [50, 60, 10**6], [5, 6, 5])
    rate_sweep(single({"c0": ["m0:0"]}), cluster, model, wl, [1.0, 2.0], plot=tmp_path / "s.png",
               options=SimOptions(beyond_context="run"))
    assert figs[0].axes[1].get_ylabel() == "requests completed (no SLO set)"
    assert list(figs[0].axes[1].lines[0].get_ydata()) == [2 / 3, 2 / 3]
    assert figs[0]._suptitle.get_text().startswith("simulated rate sweep")
    rate_sweep(single({"c0": ["m0:0"]}), cluster, model, wl, [1.0], plot=tmp_path / "s2.png",
               options=SimOptions(slo=SLO(ttft_s=10.0)), plot_title="rate sweep, times from X")
    assert figs[1].axes[1].get_ylabel() == "SLO attainment" and figs[1]._suptitle.get_text() == "rate sweep, times from X"


def test_a_large_runs_cdf_lines_draw_a_bounded_number_of_true_cdf_points(tmp_path, monkeypatch):
    """A run of 50,000 requests draws each CDF with at most CDF_POINTS points, each a point of the
    empirical CDF, the fastest and slowest request among them (a line a point per request took
    seconds to lay out and save at a million requests)."""
    from types import SimpleNamespace

    from hetserve.sim.plots import CDF_POINTS

    figs = _drawn(monkeypatch)
    rng = np.random.default_rng(0)
    n = 50_000
    ttft = rng.lognormal(size=n)
    res = SimpleNamespace(ttft=ttft, tpot=rng.lognormal(size=n), e2e=rng.lognormal(size=n),
                          output_tokens=np.full(n, 10), info={})
    plot_latency_cdfs({"run": res}, tmp_path / "cdf.png")
    lines = [ax.get_lines()[0] for ax in figs[0].axes]
    assert all(len(ln.get_xdata()) <= CDF_POINTS for ln in lines)
    x, y = lines[0].get_xdata(), lines[0].get_ydata()
    ranked = np.sort(ttft)
    assert x[0] == ranked[0] and x[-1] == ranked[-1] and y[-1] == 1.0
    ranks = np.round(y * n).astype(int)
    assert np.array_equal(x, ranked[ranks - 1])  # each drawn point: a value at its true rank
