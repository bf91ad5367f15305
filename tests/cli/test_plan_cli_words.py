"""What `hetserve plan` prints around its plans: an exact search on too large a pool is refused in
words a CLI user can act on, and nothing but the plans' own lines comes before their table."""

from __future__ import annotations

import json

from hetserve.cli.main import main

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 768, "num_attention_heads": 4, "num_hidden_layers": 8, "num_key_value_heads": 1,
          "head_dim": 64, "max_position_embeddings": 1024, "vocab_size": 320, "dtype": "float32",
          "tie_word_embeddings": False}


def test_an_exact_search_on_a_large_pool_names_what_the_cli_user_can_do(capsys):
    rc = main(["plan", "--cluster", "hexgen2-het1", "--model", "llama-2-7b", "--algorithm", "exact"])
    err = capsys.readouterr().err
    assert rc == 2 and "limited to 8 devices" in err and "--algorithm hexgen2" in err, err
    assert "PlanOptions" not in err, err  # an API field no option of the command sets


def test_compare_prints_no_blank_lines_before_its_table(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    rc = main(["plan", "--cluster", "demo-tiny", "--model", str(tmp_path / "config.json"), "--compare",
               "uniform,hexgen", "--time-limit", "2", "--max-iterations", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    head = out[:out.index(" on demo-tiny")].splitlines()  # up to the table's title
    assert all(line.strip() for line in head[:-1]), head
