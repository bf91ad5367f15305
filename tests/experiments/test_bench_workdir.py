"""Benchmarks leave no working folder behind (``bench/lib/workdir.py``): a tiny model checkpoint left in
the temporary folder by every run soon fills a small disk."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from bench.lib.workdir import workdir
d = workdir("bench-test-")
(d / "tiny").mkdir()
(d / "tiny" / "model.safetensors").write_bytes(b"0" * 1024)
print(d, flush=True)
if {fail}:
    raise RuntimeError("the benchmark failed")
"""


def run(tmp_path, fail=False, keep=False):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("HETSERVE_KEEP_WORKDIR", None)
    if keep:
        env["HETSERVE_KEEP_WORKDIR"] = "1"
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(fail=fail)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    return p, Path(p.stdout.strip())


def test_the_work_folder_goes_when_the_benchmark_ends(tmp_path):
    p, d = run(tmp_path)
    assert p.returncode == 0, p.stderr
    assert d.parent == tmp_path and not d.exists()


def test_the_work_folder_goes_when_the_benchmark_fails(tmp_path):
    p, d = run(tmp_path, fail=True)
    assert p.returncode != 0 and "the benchmark failed" in p.stderr
    assert d.parent == tmp_path and not d.exists()


def test_keep_leaves_the_folder_and_says_where(tmp_path):
    p, d = run(tmp_path, keep=True)
    assert p.returncode == 0, p.stderr
    assert (d / "tiny" / "model.safetensors").exists()
    assert f"work folder kept (HETSERVE_KEEP_WORKDIR): {d}" in p.stderr


def test_no_benchmark_makes_a_temporary_folder_it_does_not_remove():
    """``tempfile.mkdtemp`` leaves its folder; benchmarks take ``workdir`` (or a
    ``TemporaryDirectory``) instead."""
    offenders = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        if path == ROOT / "bench" / "lib" / "workdir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if name == "mkdtemp":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"mkdtemp without clean-up: {offenders}"
