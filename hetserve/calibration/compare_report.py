"""How ``hetserve compare`` prints a comparison: served against simulated, figure by figure, the
second served run beside them, the engine steps and the speed correction."""

from __future__ import annotations

from hetserve.calibration.compare import OTHERS_DISTURB, Comparison, within_band


def _ratio(r: float) -> str:
    return f"{r:.2f}" if r == r else "-"


def print_table(c: Comparison, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from hetserve.calibration.speed_probe import PROMPT_TOKENS

    console = console or Console()
    again = (c.info.get("served_again") or {}).get("table")
    t = Table("metric", "served", "simulated", "sim / served", *(["served again / served"] if again else []),
              title=f"served vs simulated — load avg {c.info['load_avg_1m'][0]} → {c.info['load_avg_1m'][1]} "
                    f"(served: measured; simulated: {c.info['simulated_source']})")
    for key, row in c.table.items():
        scale, unit = (1.0, "") if key.startswith("throughput") else (1e3, " ms")
        name = "output tokens/s" if key.startswith("throughput") else key.replace("_s.", " ").upper().replace(
            "MEAN", "mean").replace("P50", "p50").replace("P90", "p90").replace("P99", "p99") + unit
        r = row["ratio"]
        t.add_row(name, *(f"{v * scale:,.1f}" if v == v else "–" for v in (row["served"], row["simulated"])),
                  _ratio(r), *([_ratio(again[key]["ratio"])] if again else []))
    console.print(t)
    if again:
        # which reading applies follows from the two counts: a second run further from the first
        # than the simulation is says the machine moved between the runs, not that it predicts better
        apart, sim = within_band(again), within_band(c.table)
        reading = ("how far two served runs lie apart bounds how close any prediction of one can be"
                   if apart >= sim else "the served runs lie further apart than the simulation from the first: "
                   "this machine's speed moved between them (load, warm-up), so the figures within ±15 % say "
                   "little more than the runs' own spread")
        console.print(f"served twice (the same requests, the same server, one run after the other): the second "
                      f"run within ±15 % of the first in {apart} of {len(again)} figures, the "
                      f"simulation in {sim}: {reading}")
    if c.info.get("steps"):
        from hetserve.calibration.step_compare import print_steps

        print_steps(c.info["steps"]["served"], c.info["steps"]["simulated"], console)
    sp = c.info.get("speed")
    if sp:
        ref, before, after = sp["at_calibration"], sp["before"], sp["after"]
        console.print(f"machine speed (speed probe: one-token decode / {PROMPT_TOKENS}-token prompt in this process): "
                      f"{before['decode_s'] * 1e3:.2f} / {before['prefill_s'] * 1e3:.1f} ms before serving, "
                      f"{after['decode_s'] * 1e3:.2f} / {after['prefill_s'] * 1e3:.1f} ms after, "
                      f"{ref['decode_s'] * 1e3:.2f} / {ref['prefill_s'] * 1e3:.1f} ms at calibration, a ratio of "
                      f"x{sp['slowdown']:.2f}; simulated times x{sp['applied']:.2f} (the ratio "
                      f"to the power {sp['weight']:g}; as calibrated, {within_band(sp['table_as_calibrated'])} "
                      f"of {len(c.table)} figures within ±15 %, with the correction {within_band(c.table)})")
    others = c.info.get("other_cores_busy")
    if others is not None:
        console.print(f"other processes on this machine kept {others:.2f} cores busy during the replay"
                      + (" — the served figures carry their load" if others > OTHERS_DISTURB else ""))
