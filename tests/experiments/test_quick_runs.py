"""The paper reproductions still run end to end (their ``--quick`` variants, trimmed further).

Each checks the table it prints has the rows the experiment page quotes; the numbers themselves
live in docs/experiments/*.md (not asserted: they are measurements)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name):
    """Load an experiment script as ``python experiments/NAME.py`` would: its folder on the path,
    so the sibling modules it imports (e.g. ``aladdin_setting``) resolve."""
    if str(ROOT / "experiments") not in sys.path:
        sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_molink_equal_counts_quick(capsys):
    assert load("molink_tables").main(["--quick", "--minutes", "1"]) == 0
    out = capsys.readouterr().out
    assert "Same micro-batch count" in out and "| 0.3 | 3 |" in out and "| 0.3 | 6 |" in out


@pytest.mark.long
def test_hexgen_budget_quick(capsys):
    assert load("hexgen_budget").main(["--quick", "--requests", "60", "--search-s", "5", "--rates", "1"]) == 0
    out = capsys.readouterr().out
    for pool in ("homogeneous 16×A100-40G", "hexgen-full-price", "hexgen-half-price"):
        assert f"| 32 | {pool} |" in out


def test_aladdin_same_plan_over_windows_quick(capsys):
    args = ["--quick", "--sections", "same", "--rates", "5", "--requests", "100", "--windows", "2"]
    assert load("aladdin_figures").main(args) == 0
    out = capsys.readouterr().out
    for trace in ("ShareGPT, Poisson", "Azure conv (bursty, held out)"):
        assert f"| {trace} | 5 | 2 |" in out  # two windows per point
    assert "Aladdin (true lengths) mean ≥ JSQ mean at" in out
