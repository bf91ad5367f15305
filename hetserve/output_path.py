"""The check a command makes on a file it will write, before the work that fills it (a calibration
measures for minutes, a plan searches for as long as it is let): a path it cannot write is refused
first, in one line, rather than after the work is done and lost."""

from __future__ import annotations

import os
from pathlib import Path

from hetserve.errors import SpecError


def write_whole(path: str | Path, text: str) -> None:
    """``text`` written to ``path`` whole or not at all: into a hidden file beside it, then renamed
    over it, so a run stopped while writing (a signal, a full disk) leaves what was there before,
    and a reader never sees half a file."""
    path = Path(path)
    part = path.with_name(f".{path.name}.part")
    try:
        part.write_text(text)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def check_output_file(path: str, flag: str) -> None:
    """``path`` (given as ``flag``) names a file in an existing folder that can be written."""
    target = Path(path)
    if target.is_dir():
        raise SpecError(path, flag, "a file to write", "a folder")
    folder = target.parent
    if not folder.is_dir():
        raise SpecError(path, flag, "a file in an existing folder",
                        f"{folder} is not a folder" if folder.exists() else f"no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise SpecError(path, flag, "a file in a folder this user can write", f"{folder} is read-only")


def check_plot_file(path: str, flag: str) -> None:
    """``check_output_file``, and ``path`` ends in a format matplotlib writes (``.png``, ``.pdf``,
    ``.svg`` …): an unknown one failed in ``savefig`` after the work, and none had ``.png`` added."""
    check_output_file(path, flag)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in formats:
        raise SpecError(path, flag, "a picture file ending in " + ", ".join(f".{f}" for f in sorted(formats)),
                        f".{suffix}" if suffix else "no extension")


def check_output_folder(path: str, flag: str) -> None:
    """``path`` (given as ``flag``) is a folder, or one that can be made: not an existing file."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise SpecError(path, flag, "a folder to write into", "an existing file")
    above = next((p for p in target.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # mkdir would fail after the work, "Not a directory"
        raise SpecError(path, flag, "a folder that can be made", f"{above} is a file")


def holding(folder: str | Path, names: list[str] | None = None, shown: int = 3, also: bool = False) -> str:
    """"a folder holding a, b, c … (N in all)": the first ``shown`` of ``names`` (default: the folder's
    entries), for a refusal that says what is in the way of a command writing there (``also``: beside
    what the command may replace, "a folder also holding …")."""
    names = sorted(names if names is not None else (p.name for p in Path(folder).iterdir()))
    return (f"a folder {'also ' if also else ''}holding " + ", ".join(names[:shown])
            + (f" … ({len(names)} in all)" if len(names) > shown else ""))


def check_distinct(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """No file written (``{flag: path}``) is a file read or another file written: ``-o`` onto the
    cluster file a plan is made on would replace the input with the plan."""
    seen: dict[Path, str] = {}
    for flag, path in inputs.items():
        if path and Path(path).is_file():
            seen[Path(path).resolve()] = flag
    for flag, path in outputs.items():
        if not path:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise SpecError(path, flag, "a file other than the command's other files", f"the {seen[key]} file")
        seen[key] = flag
