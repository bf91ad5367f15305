"""The compiled copy of the package (``make fast-sim``): whether it was built from the sources a
checkout holds now.

``make fast-sim`` copies ``hetserve/`` into ``.fast-sim/``, compiles the simulator's hot modules
there and then writes ``stamp``: a digest of every ``.py`` file of the copy. A copy whose digest
differs from the checkout's sources was built from other code, and measuring it would measure
that code; ``check`` says so and how to rebuild.

    python -m bench.lib.fast_sim stamp .fast-sim     # after a build (the Makefile does it)
    python -m bench.lib.fast_sim check .fast-sim     # exit 1 with the reason if stale or absent
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

STAMP = "SOURCES.sha256"


def sources_digest(root: Path) -> str:
    """sha256 over the path and bytes of every ``.py`` file under ``root/hetserve``, in path order."""
    h = hashlib.sha256()
    for f in sorted((root / "hetserve").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def stamp(copy: Path) -> None:
    """Record the digest of the copy's sources (they are the checkout's as copied)."""
    (copy / STAMP).write_text(sources_digest(copy) + "\n")


def problem(copy: Path, checkout: Path) -> str | None:
    """Why ``copy`` is not a build of ``checkout``'s sources now (None: it is)."""
    built = copy / STAMP
    if not built.is_file():
        return f"no compiled copy at {copy} (no {STAMP}): run `make fast-sim`"
    if built.read_text().strip() != sources_digest(checkout):
        return f"the compiled copy at {copy} was built from other sources than {checkout}'s: run `make fast-sim` again"
    if not any((copy / "hetserve").rglob("*.so")):
        return f"the copy at {copy} holds no compiled module: run `make fast-sim` again"
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("stamp", "check"):
        print("usage: python -m bench.lib.fast_sim stamp|check COPY", file=sys.stderr)
        return 2
    copy = Path(argv[1]).resolve()
    if argv[0] == "stamp":
        stamp(copy)
        return 0
    why = problem(copy, Path(__file__).resolve().parents[2])
    if why:
        print(why, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
