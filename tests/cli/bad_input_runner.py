"""Runs one bad-input case through the CLI's ``main`` in this process and says what became of it.

A case is a command line, the files it names (written into a fresh folder per case) and the words
its one-line error must hold. Its outcome is one of:

- ``error``: a non-zero exit, one line on stderr (lines starting ``warning:`` aside), no traceback;
- ``traceback``: an exception escaped ``main``;
- ``accepted``: exit code 0, or the command got as far as its work (starting workers, searching,
  measuring, binding a router): the input was taken;
- ``unclear``: a non-zero exit whose message is not one line.

The work itself is replaced by a stub that stops the command where it would begin (``STUBS``), so a
case that is wrongly accepted is seen at once and costs nothing: no worker starts, no search runs.
"""

from __future__ import annotations

import contextlib
import json
import importlib
import io
import os
import shlex
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# where each command's work begins: reaching it means every input was accepted
STUBS = {
    "serve": ("hetserve.cli.commands.serve", "_start_and_serve"),
    "compare": ("hetserve.serve.launch", "start_server"),
    "calibrate": ("hetserve.calibration.calibrate", "calibrate"),
    "route": ("hetserve.serve.server", "serve_plain"),
    "plan": ("hetserve.planner.objectives", "plan_for"),
}


@dataclass(frozen=True)
class Case:
    """``argv``: the command line, ``{d}`` standing for the case's folder; ``files``: name -> text,
    bytes, or None for a folder (written under ``{d}`` besides ``BASE_FILES``); ``words``: what the
    error line must hold; ``accepted``: the input is legitimate and taken, and why (then the case
    expects ``accepted``); ``real``: run the command's work instead of its stub."""

    id: str
    argv: str
    words: tuple[str, ...] = ()
    files: dict = field(default_factory=dict)
    accepted: str = ""
    real: bool = False

    @property
    def command(self) -> str:
        return shlex.split(self.argv)[0]

    @property
    def expected(self) -> str:
        return "accepted" if self.accepted else "error"


@dataclass(frozen=True)
class Result:
    outcome: str  # error | traceback | accepted | unclear
    code: int | None
    message: str  # the error line, the exception, or what the accepted command reached
    missing: tuple[str, ...] = ()  # words the error line lacks


class _Reached(Exception):
    """The command got to its work: every input was taken."""


def _stub(what: str):
    def reached(*args, **kwargs):
        raise _Reached(what)
    return reached


def write_files(folder: Path, files: dict) -> None:
    for name, content in files.items():
        path = folder / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = None
        if isinstance(content, tuple):  # (content, mode): a key file only its owner may read
            content, mode = content
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        if mode is not None:
            path.chmod(mode)


def run_case(case: Case, folder: Path, base_files: dict | None = None) -> Result:
    """Write the case's files under ``folder``, run its command line, classify what happened."""
    from hetserve.cli.main import main

    folder.mkdir(parents=True, exist_ok=True)
    write_files(folder, {**(base_files or {}), **case.files})
    argv = [a.replace("{d}", str(folder)) for a in shlex.split(case.argv)]
    saved = []
    if case.command in STUBS and not case.real:
        module = importlib.import_module(STUBS[case.command][0])
        name = STUBS[case.command][1]
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, _stub(f"{module.__name__}.{name}"))
    out, err = io.StringIO(), io.StringIO()
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HETSERVE_DEBUG", "HETSERVE_API_KEY",
                                          "HETSERVE_ADMIN_KEY")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    for k in ("HETSERVE_DEBUG", "HETSERVE_API_KEY", "HETSERVE_ADMIN_KEY"):
        os.environ.pop(k, None)
    cwd = os.getcwd()
    try:
        os.chdir(folder)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 2
    except _Reached as exc:
        return Result("accepted", None, f"reached {exc}")
    except Exception as exc:  # noqa: BLE001 - an escaped exception is the outcome being measured
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result("traceback", None, last)
    finally:
        os.chdir(cwd)
        for module, name, value in saved:
            setattr(module, name, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    errors = [ln for ln in lines if not ln.startswith("warning:")]
    if code == 0:
        return Result("accepted", 0, (lines or ["exit code 0"])[0])
    if len(errors) != 1 or "Traceback" in err.getvalue():
        return Result("unclear", code, " | ".join(errors)[:300] or "(nothing on stderr)")
    line = errors[0].replace(str(folder), "{d}")
    return Result("error", code, line, tuple(w for w in case.words if w not in line))


# ---------------------------------------------------------------- the files every case's folder holds

CLUSTER = ("name: c\nmachines:\n  - {name: a, gpu: RTX-4090, count: 2, site: s1}\n"
           "  - {name: b, gpu: L4, count: 2, site: s1}\nnetwork:\n  intra_site: {bandwidth_gbps: 10, latency_ms: 0.2}\n")
CONFIG = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128}
PLAN = {"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["h100-0:0"], "layers": [0, 32]}]}]}
PD_PLAN = {"model": "llama-2-7b", "cluster": "hexgen2-homo", "replicas": [
    {"id": "p0", "role": "prefill", "stages": [{"devices": ["h100-0:0"], "layers": [0, 32]}]},
    {"id": "d0", "role": "decode", "stages": [{"devices": ["h100-0:1"], "layers": [0, 32]}]}],
    "kv_routes": [{"from": "p0", "to": "d0", "weight": 1.0}]}
TINY_PLAN = {"model": "m", "cluster": "demo-cpu", "replicas": [
    {"id": "c0", "role": "colocated", "stages": [{"devices": ["m0:0"], "layers": [0, 2]}]}]}
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
TRACE = HEADER + "".join(f"{k * 0.5},{100 + k},{20}\n" for k in range(6))
BASE_FILES = {"c.yaml": CLUSTER, "m/config.json": json.dumps(CONFIG), "plan.json": json.dumps(PLAN),
              "pd.json": json.dumps(PD_PLAN),
              "tiny.json": json.dumps(TINY_PLAN), "t.csv": TRACE, "dir": None}
BINARY = b"\x1f\x8b\x08\x00\xff\xfe\x00\x00binary"
SIM = "simulate --plan {d}/plan.json --workload {d}/t.csv --no-progress"


def plan_with(**changes) -> str:
    return json.dumps({**PLAN, **changes})


def stage(devices, layers, rid="c0", role="colocated") -> dict:
    return {"id": rid, "role": role, "stages": [{"devices": devices, "layers": layers}]}


def config_with(**changes) -> str:
    return json.dumps({**CONFIG, **changes})


def cluster_machine(extra: str) -> str:
    return f"name: c\nmachines:\n  - {{name: a, gpu: RTX-4090, {extra}}}\n"


def check_case(case: Case, folder: Path) -> None:
    """Run ``case`` (with ``BASE_FILES``) and assert what it expects: taken, or refused with exit 2
    in one line holding every word it names."""
    r = run_case(case, folder, BASE_FILES)
    assert r.outcome == case.expected, f"{case.argv}: {r.outcome}: {r.message}"
    if r.outcome == "error":
        assert r.code == 2, r
        assert not r.missing, f"the line lacks {r.missing}: {r.message}"
