"""``bench.lib.fast_sim``: a compiled copy counts as a build of the checkout only while its
sources are the checkout's; any edit, a missing stamp or a copy without compiled modules is
refused with a way out."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.lib.fast_sim import main, problem, stamp


def _tree(root: Path) -> Path:
    (root / "hetserve" / "sim").mkdir(parents=True)
    (root / "hetserve" / "__init__.py").write_text("")
    (root / "hetserve" / "sim" / "sharing.py").write_text("RATE = 1\n")
    return root


def test_a_fresh_copy_passes_and_any_source_edit_makes_it_stale(tmp_path):
    checkout = _tree(tmp_path / "checkout")
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy)
    (copy / "hetserve" / "sim" / "sharing.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    stamp(copy)
    assert problem(copy, checkout) is None

    (checkout / "hetserve" / "sim" / "sharing.py").write_text("RATE = 2\n")
    assert "built from other sources" in problem(copy, checkout)
    (checkout / "hetserve" / "sim" / "sharing.py").write_text("RATE = 1\n")
    (checkout / "hetserve" / "sim" / "new.py").write_text("")  # a file added counts too
    assert "built from other sources" in problem(copy, checkout)


def test_no_stamp_or_no_compiled_module_is_refused(tmp_path):
    checkout = _tree(tmp_path / "checkout")
    copy = tmp_path / "copy"
    shutil.copytree(checkout, copy)
    assert "make fast-sim" in problem(copy, checkout)
    stamp(copy)
    assert "no compiled module" in problem(copy, checkout)
    assert main(["check"]) == 2  # usage
