"""A benchmark's working folder: its tiny model checkpoint, cluster files and calibrations.

Every benchmark that serves writes a few tens of MB there, and a folder left in the temporary
folder by each run soon fills a small disk. ``workdir`` removes the folder when the benchmark's
process ends (normally or by an exception; a killed process leaves it). Set
``HETSERVE_KEEP_WORKDIR=1`` to keep it for a look afterwards: its path is printed then.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

KEEP_ENV = "HETSERVE_KEEP_WORKDIR"


def workdir(prefix: str, dir: str | None = None) -> Path:
    """A new folder under ``dir`` (default: the system's temporary folder), removed at exit unless
    ``HETSERVE_KEEP_WORKDIR`` is set."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    if os.environ.get(KEEP_ENV, "") not in ("", "0"):
        atexit.register(lambda: print(f"work folder kept ({KEEP_ENV}): {path}", file=sys.stderr))
    else:
        atexit.register(shutil.rmtree, path, True)
    return path
