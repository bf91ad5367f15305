"""``make-model``'s shape refusals name the option the user gave and where the value it clashes
with came from (--like's preset or the default); the rules are ``make_model``'s own (check_shape)."""

from __future__ import annotations

import argparse

import pytest

from hetserve.cli.commands.make_model import _shape
from hetserve.cli.main import main
from hetserve.runtime.model.make import ShapeError, check_shape


@pytest.mark.parametrize("argv, line", [
    (["--like", "llama-2-7b", "--heads", "4"],
     "--heads: expected a multiple of the KV heads (32, from --like llama-2-7b; pass --kv-heads), got 4"),
    (["--like", "llama-2-7b", "--kv-heads", "3"],
     "--kv-heads: expected a divisor of the heads (32, from --like llama-2-7b; pass --heads), got 3"),
    (["--hidden", "66"], "--hidden: expected a multiple of the heads (4, the default; pass --heads), got 66"),
    (["--hidden", "66", "--heads", "4"], "--hidden: expected a multiple of --heads (4), got 66"),
    (["--vocab", "100"], "--vocab: expected at least 259 (256 bytes + <bos> <eos> <pad>), got 100"),
    # a preset of an architecture make-model does not write: the option to blame is --like, not an
    # --arch the user never gave, and the way on is --arch llama
    (["--like", "qwen2-7b"], "--like: expected a preset of an architecture make-model writes (llama, opt), or "
     "--arch beside it (--arch llama: a Llama of the qwen2 preset's shape), got 'qwen2-7b'"),
])
def test_a_shape_refusal_names_the_options_and_where_the_other_value_came_from(tmp_path, capsys, argv, line):
    assert main(["make-model", *argv, "--random-weights", "-o", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip() == f"hetserve make-model: error: {line}"
    assert not (tmp_path / "m").exists()


def test_a_llama_preset_made_opt_leaves_its_kv_heads_behind():
    args = argparse.Namespace(like="llama-2-70b", arch="opt", layers=None, hidden=None, heads=None, kv_heads=None,
                              ffn=None, vocab=None, max_positions=None, dtype=None)
    origin = _shape(args)
    assert args.kv_heads is None and args.heads == 64 and origin["heads"] == "from --like llama-2-70b"
    check_shape(args.arch, args.hidden, args.heads, args.kv_heads, args.vocab)  # OPT has no GQA to clash
    with pytest.raises(ShapeError) as e:
        check_shape("opt", 8192, 64, 8, 32000)
    assert e.value.fields == ("kv_heads",) and "OPT" in e.value.expected
