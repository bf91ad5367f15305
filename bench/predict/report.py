"""What ``predict/run`` prints: the served-vs-simulated table of its cells, the hits within ±15 %
(the simulation's, as calibrated, the baseline's, the second served run's) and the
calibration target (every point of each plan's calibration within ±10 %).
"""

from __future__ import annotations

METRICS = ["throughput_tokens_per_s", "ttft_s.mean", "ttft_s.p90", "tpot_s.mean", "tpot_s.p90",
           "e2e_s.mean", "e2e_s.p90"]
CALIBRATION_BAND = 0.10  # the calibration fit's target: every point within ±10 %


def print_cells(cells: list[dict], title: str, console) -> None:
    from rich.table import Table

    from hetserve.calibration.compare import OTHERS_DISTURB, in_band

    twice = any(c.get("served_again") for c in cells)
    t = Table("plan", "rate", "load", "other cores", "slow-down", "metric", "served", "sim", "sim/served", "±15%",
              "as calibrated", "baseline/served", *(["served again/served"] if twice else []), title=title)
    hits = total = base_hits = cal_hits = again_hits = sim_again_hits = 0
    disturbed = [c for c in cells if (c.get("other_cores_busy") or 0.0) > OTHERS_DISTURB]
    for cell in cells:
        for m in METRICS:
            row, brow = cell["table"][m], cell.get("baseline_table", {}).get(m)
            crow = ((cell.get("speed") or {}).get("table_as_calibrated") or {}).get(m, row)
            cal_hits += in_band(crow["ratio"])
            scale = 1.0 if m.startswith("throughput") else 1e3
            ok = in_band(row["ratio"])
            hits, total = hits + ok, total + 1
            base_hits += brow is not None and in_band(brow["ratio"])
            arow = (cell.get("served_again") or {}).get("table", {}).get(m)
            again_hits += arow is not None and in_band(arow["ratio"])
            # the simulation against the second run: its "simulated" column is that run's figure
            sim_again_hits += arow is not None and in_band(row["simulated"] / arow["simulated"])
            t.add_row(cell["plan"], f"{cell['rate']:.2f}", f"{cell['load_avg_1m'][0]:.1f}",
                      fmt_others(cell.get("other_cores_busy")), _fmt_slowdown(cell.get("speed")),
                      m.replace("_s.", " ") + ("" if scale == 1 else " ms"),
                      f"{row['served'] * scale:,.1f}",
                      f"{row['simulated'] * scale:,.1f}", f"{row['ratio']:.2f}", "yes" if ok else "NO",
                      f"{crow['ratio']:.2f}", f"{brow['ratio']:.2f}" if brow else "-",
                      *([f"{arow['ratio']:.2f}" if arow else "-"] if twice else []))
    console.print(t)
    console.print(f"within ±15 %: {hits} of {total} (baseline simulator: {base_hits} of {total}); ratio "
                  f"{hits / max(base_hits, 1):.2f}x the baseline's hits; at the calibration's machine speed, without "
                  f"the speed probe's correction: {cal_hits} of {total}")
    if twice:
        console.print(f"served twice (--serve-twice: the same requests again on the same server): the second run "
                      f"within ±15 % of the first in {again_hits} of {total} figures (the simulation within ±15 % of the "
                      f"second run: {sim_again_hits}): two served runs of one cell lie that far apart")
    within, points, all_within, cals, misses = calibration_fit(cells)
    if points:
        console.print(f"calibration fit (each plan's `hetserve calibrate`): {within} of {points} points within "
                      f"±{CALIBRATION_BAND * 100:.0f} %, {all_within} of {cals} calibrations with every point within"
                      + (f"; off: {', '.join(misses)}" if misses else ""))
    if disturbed:
        names = ", ".join(f"{c['plan']} {c['rate']:.2f}" for c in disturbed)
        console.print(f"{len(disturbed)} of {len(cells)} cells were served while other processes kept more than "
                      f"{OTHERS_DISTURB} cores busy ({names}):"
                      " their served figures measure the neighbours too; run again on a quiet machine")


def calibration_fit(cells: list[dict]) -> tuple[int, int, int, int, list[str]]:
    """Issue 13's calibration target over the distinct calibrations ``cells`` used (each cell keeps
    its calibration's content; a ``--refit`` replay the content fitted again): (points within
    ±10 %, points, calibrations with every point within, calibrations, the misses as text)."""
    from hetserve.calibration.compare import in_band
    from hetserve.calibration.calibrate import CalibrationPoint

    seen: dict[str, list[dict]] = {}
    for c in cells:
        points = (c.get("calibration_data") or {}).get("points")
        if points:
            seen.setdefault(c["calibration"], points)
    within = total = all_within = 0
    misses = []
    for points in seen.values():
        errors = [(p, CalibrationPoint(**p).error) for p in points]
        off = [(p, e) for p, e in errors if not in_band(1 + e, CALIBRATION_BAND)]
        within, total, all_within = within + len(points) - len(off), total + len(points), all_within + (not off)
        misses += [f"{p['phase']} {p['size']} on {p.get('stages', 1)} stage(s) TP {p.get('tp', 1)} {e:+.1%}"
                   for p, e in off]
    return within, total, all_within, len(seen), misses


def _fmt_slowdown(speed) -> str:
    """The machine's slow-down since calibration the speed probe read around a cell (``-``: none)."""
    return "-" if not speed else f"x{speed['slowdown']:.2f}"


def fmt_others(cores) -> str:
    """Cores other processes kept busy while a cell was served (``-``: not measured, an old file)."""
    return "-" if cores is None else f"{cores:.2f}"
