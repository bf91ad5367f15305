"""Output cut short by its reader (``hetserve ... | head -1``): the command ends quietly with exit
code 0 (hetserve.cli.main), for rich's tables and plain prints alike."""

from __future__ import annotations

import subprocess
import sys

import pytest

HETSERVE = [sys.executable, "-m", "hetserve.cli.main"]
# rich's tables (describe) and plain prints (cost layer)
COMMANDS = [["describe", "cluster", "hexgen2-het1"], ["describe", "workload", "azure-conv"],
            ["cost", "layer", "--gpu", "H200", "--model", "llama-2-7b"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_a_reader_gone_before_the_first_write_ends_the_command_quietly(argv):
    # the read end is closed before the interpreter has started, so every write meets a closed pipe
    proc = subprocess.Popen(HETSERVE + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == ""


def test_piped_into_head_the_first_line_comes_and_nothing_else():
    cmd = " ".join(HETSERVE + ["describe", "cluster", "hexgen2-het1"])
    out = subprocess.run(["bash", "-c", f"{cmd} | head -1; exit ${{PIPESTATUS[0]}}"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("cluster hexgen2-het1:") and out.stdout.count("\n") == 1
