"""The bad-input corpus (``bad_inputs.py``), case by case: each bad input is refused in one line that
names what was wrong (exit code 2, no traceback); each legitimate one is accepted. A case that starts
to trace back, or to be accepted without its reason written down, fails here."""

from __future__ import annotations

import pytest

from .bad_input_runner import check_case
from .bad_inputs import CASES


def test_the_corpus_covers_every_command():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    commands = {c.command for c in CASES}
    assert {"plan", "simulate", "describe", "capacity", "compare", "cost", "export", "make-model", "calibrate",
            "route", "serve"} <= commands


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path):
    check_case(case, tmp_path / "case")
