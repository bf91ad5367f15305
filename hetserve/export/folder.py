"""The folder a bundle is written into: new or empty, or (with ``replace``) one holding only an
earlier bundle, whose files are removed before the new one is written.

A bundle's scripts are run as ``machines/*.sh``: an earlier bundle's script left beside a new one
would start processes of another plan. So a bundle lists the files it wrote in ``bundle.json``
(``MANIFEST``), and only those are ever removed: any other file in the folder is the user's, and a
folder holding one is refused rather than cleared. A manifest entry is removed only where its name
is one a bundle writes (``BUNDLE_FILE``), so an edited manifest cannot name a file elsewhere.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hetserve.errors import SpecError

MANIFEST = "bundle.json"
# the names a bundle writes: its fixed files, the copied cluster file and one script per machine
BUNDLE_FILE = re.compile(r"(plan\.json|deploy\.json|router\.json|README\.md|cluster\.yaml|machines/[^/\\]+\.sh)")
FLAG = "--output"
REPLACE = "--force"


def manifest(files: list[Path], out_dir: str | Path, engine: str) -> str:
    """The text of ``bundle.json``: what wrote the folder, and every file it wrote (relative paths)."""
    from hetserve import __version__

    rel = sorted(p.relative_to(out_dir).as_posix() for p in files)
    return json.dumps({"made_by": f"hetserve export --to {engine}", "hetserve_version": __version__,
                       "files": rel}, indent=1) + "\n"


def earlier_bundle(out_dir: str | Path) -> list[Path] | None:
    """The files an earlier bundle in ``out_dir`` wrote, as its ``bundle.json`` lists them (those still
    there); None where the folder holds no readable manifest of a bundle."""
    out = Path(out_dir)
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and BUNDLE_FILE.fullmatch(f) for f in files):
        return None
    return [out / f for f in files if (out / f).is_file() or (out / f).is_symlink()]


def _written_by(out_dir: str | Path) -> str:
    """"an earlier bundle written by hetserve export (vllm)": which exporter, as the earlier bundle's
    manifest says (its ``made_by``); the engine left out where the manifest names none we know."""
    try:
        made_by = json.loads((Path(out_dir) / MANIFEST).read_text()).get("made_by", "")
    except (OSError, ValueError, AttributeError):
        made_by = ""
    m = re.fullmatch(r"hetserve export --to (hetserve|vllm|sglang)", made_by if isinstance(made_by, str) else "")
    return "an earlier bundle written by hetserve export" + (f" ({m[1]})" if m else "")


def _others(out: Path, bundle: list[Path]) -> list[str]:
    """Everything in ``out`` that is not the earlier bundle's (its files, manifest and machines/ folder)."""
    mine = {p.relative_to(out).as_posix() for p in bundle} | {MANIFEST, "machines"}
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                  if p.relative_to(out).as_posix() not in mine)


def check_bundle_folder(out_dir: str | Path, replace: bool) -> list[Path]:
    """Refuse ``out_dir`` unless it is new or empty, or ``replace`` is set and it holds only an earlier
    bundle. Returns the earlier bundle's files (and manifest) to remove before writing; [] for none."""
    from hetserve.output_path import check_output_folder, holding

    check_output_folder(str(out_dir), FLAG)
    out = Path(out_dir)
    if not out.is_dir() or not any(out.iterdir()):
        return []
    bundle = earlier_bundle(out)
    if not replace:
        expected = (f"a new or empty folder (it holds {_written_by(out)}: {REPLACE} replaces it)"
                    if bundle is not None else "a new or empty folder")
        raise SpecError(str(out_dir), FLAG, expected, holding(out))
    if bundle is None:
        raise SpecError(str(out_dir), FLAG, f"with {REPLACE}, a folder holding only an earlier bundle written by "
                        f"hetserve export (its {MANIFEST} lists the files {REPLACE} removes)", holding(out) + f" and no {MANIFEST}")
    others = _others(out, bundle)
    if others:
        raise SpecError(str(out_dir), FLAG, f"with {REPLACE}, a folder holding only {_written_by(out)} "
                        f"({REPLACE} removes only the files its {MANIFEST} lists; move the others away)",
                        holding(out, others, also=True))
    return bundle + [out / MANIFEST]


def remove_bundle(out_dir: str | Path, files: list[Path]) -> None:
    """Remove an earlier bundle's files (``check_bundle_folder``'s list), and its machines/ folder
    once empty."""
    for p in files:
        p.unlink(missing_ok=True)
    machines = Path(out_dir) / "machines"
    if machines.is_dir() and not any(machines.iterdir()):
        machines.rmdir()
