"""Pre-run checks of the paths a command will write, shared by the simulator's and the engine's
commands, so that a path refused is refused before any work and one accepted is writable."""

from __future__ import annotations

import tempfile
from pathlib import Path


def write_refused(directory: Path | str) -> str | None:
    """Why a file cannot be created in ``directory`` (the OS's words), or None when it can.

    Tested by creating and removing a temporary file there: the one test that holds for root
    (for whom ``os.access`` is always true), read-only mounts and ``/proc`` alike.
    """
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor: where a directory that
    is created later can be test-written now, without creating anything."""
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    return existing
