"""The ``--model`` check that every command serving or measuring a real checkpoint makes first."""

from __future__ import annotations

from pathlib import Path

from hetserve.errors import SpecError
from hetserve.specs.model import ModelSpec


def check_model_dir(path: str) -> None:
    """The checkpoint folder exists and its config.json reads as a supported model: one line, exit
    code 2, before any process starts (a preset name would otherwise go to the Hugging Face hub)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise SpecError(path, "--model", "a checkpoint folder holding config.json (see `hetserve make-model`)",
                        "no such folder" if not folder.exists() else "no config.json in it")
    ModelSpec.from_hf_config(folder)
