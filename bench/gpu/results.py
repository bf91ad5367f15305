"""How the GPU checks keep what they measured: a JSON file and a markdown table rewritten whole after
every stage (a kill by the time limit mid-write leaves the previous pair), and stages that record
their failure and let the next one run."""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
import types
from pathlib import Path
from typing import Callable


def write_results(out: Path, stem: str, data: dict, table: str) -> None:
    """``out/stem.json`` (``data``) and ``out/stem.md`` (``table``), each replaced whole."""
    for name, text in ((f"{stem}.json", json.dumps(data, indent=2)), (f"{stem}.md", table)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n")
        os.replace(tmp, out / name)


class StageReport:
    """A check's results (``data``, with ``errors`` and ``wall_s``), saved after every stage by
    ``table(data)``; a stage that raises is recorded (its traceback under ``errors``)."""

    def __init__(self, out: Path, stem: str, data: dict, table: Callable[[dict], str]):
        self.out, self.stem, self.table = out, stem, table
        self.data = {**data, "errors": [], "wall_s": 0.0}
        self.t0 = time.perf_counter()

    def error(self, stage: str, text: str) -> None:
        self.data["errors"].append({"stage": stage, "error": text})
        print(f"ERROR in {stage}: {text}", flush=True)

    @contextlib.contextmanager
    def stage(self, name: str):
        """``with report.stage(name) as st``: ``st.ok`` says, after the block, whether it completed."""
        print(f"-- {name}", flush=True)
        st = types.SimpleNamespace(ok=False)
        try:
            yield st
            st.ok = True
        except Exception:  # noqa: BLE001 - recorded; the next stage runs
            self.error(name, traceback.format_exc())
        finally:
            self.save()

    def save(self) -> None:
        self.data["wall_s"] = time.perf_counter() - self.t0
        write_results(self.out, self.stem, self.data, self.table(self.data))
