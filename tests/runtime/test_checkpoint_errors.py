"""A damaged checkpoint is refused before any worker starts, in one line naming the file.

Truncated or foreign ``model.safetensors``, a sharded index that is not JSON, lacks its
``weight_map`` or names a file that is not there, and a truncated shard: each is a ``SpecError``
from ``check_weights``, and ``hetserve serve`` exits 2 with that one line (no traceback).
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hetserve.cli.main import main as cli
from hetserve.errors import SpecError
from hetserve.planner.plan import Plan
from hetserve.runtime.model.loader import CheckpointReader, check_weights


@pytest.fixture
def llama(model_dirs, tmp_path):
    """A copy of the session's tiny Llama to damage."""
    return shutil.copytree(model_dirs["llama"], tmp_path / "llama")


def _truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _sharded(model_dir) -> list[str]:
    """Split ``model.safetensors`` into two shards with an index; the shard names."""
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, model_dir / file)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    return list(shards)


@pytest.mark.parametrize("keep", [8, 1000, -64], ids=["header-cut", "data-cut-early", "data-cut-late"])
def test_a_truncated_weights_file_is_refused_naming_it(llama, keep):
    weights = llama / "model.safetensors"
    _truncate(weights, keep if keep > 0 else weights.stat().st_size + keep)
    with pytest.raises(SpecError) as err:
        check_weights(llama)
    assert err.value.field == "model.safetensors" and str(llama) in str(err.value)


def test_a_sharded_checkpoint_reads_and_each_fault_of_its_index_or_shards_is_named(llama):
    first, second = _sharded(llama)
    reader = CheckpointReader(llama)
    assert len(reader.files) == len(load_file(llama / first)) + len(load_file(llama / second))
    reader.close()
    index = llama / "model.safetensors.index.json"
    good = index.read_text()

    index.write_text("{not json")
    with pytest.raises(SpecError, match="weight_map"):
        check_weights(llama)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(SpecError, match="weight_map"):
        check_weights(llama)

    index.write_text(good)
    (llama / second).rename(llama / "elsewhere.safetensors")
    with pytest.raises(SpecError, match=second):
        check_weights(llama)

    (llama / "elsewhere.safetensors").rename(llama / second)
    _truncate(llama / second, 100)
    with pytest.raises(SpecError) as err:
        check_weights(llama)
    assert err.value.field == second


def test_serve_refuses_a_truncated_checkpoint_in_one_line(llama, tmp_path, capsys):
    _truncate(llama / "model.safetensors", 1000)
    plan = tmp_path / "plan.json"
    Plan.from_dict({"model": "tiny", "cluster": "demo-cpu", "replicas": [
        {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 3]}]}]}).save(plan)
    code = cli(["serve", "--plan", str(plan), "--cluster", "demo-cpu", "--model", str(llama), "--port", "0"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after serve's "starting local workers ..." line
    assert code == 2 and "Traceback" not in err, err
    assert last.startswith("hetserve") and "model.safetensors" in last and "safetensors file" in last, err
