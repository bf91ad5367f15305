"""What ``hetserve calibrate`` prints of attention's efficiencies: a fitted value, or what the cost
model takes where no probe measured it (``Efficiency``'s 0 means "as compute" / "as prompts", and
printed as "attention 0" it read as attention at no speed at all)."""

import argparse

from hetserve.cli.commands.calibrate import PROBE_DEFAULTS, _attention
from hetserve.cost.efficiency import Efficiency


def args(**changes) -> argparse.Namespace:
    return argparse.Namespace(**{**PROBE_DEFAULTS, **changes})


def test_unfitted_attention_says_what_it_is_taken_as_and_why():
    text = _attention(Efficiency(attention=0.0, decode_attention=0.0), args(prompt_lengths=(32, 64)))
    assert text.startswith("as compute (prompts; not fitted: it needs three or more --prompt-lengths, 2 given)")
    assert "as prompts (a decode step over its context; not fitted: no long-context probe)" in text
    assert " 0 " not in f" {text} " and "0 (" not in text
    assert "--no-long-decode)" in _attention(Efficiency(), args(no_long_decode=True))


def test_fitted_attention_prints_its_values():
    text = _attention(Efficiency(attention=0.0123, decode_attention=0.00456), args())
    assert text == "0.0123 (prompts), 0.00456 (a decode step over its context)"
