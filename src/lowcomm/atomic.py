"""Atomic file writing: a reader sees either the old file or the whole new one.

Every file lowcomm writes for someone else to read (config.json, summary.json, metrics, reports,
checkpoints, the corpus cache) goes through here: a temporary file in the same directory
(``os.replace`` is atomic only within one file system), flushed and fsynced, then renamed over
the target. The temporary name starts with ``.NAME.tmp`` so that ``--overwrite`` can find the
leftovers of an interrupted write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to (for writers that take a path, such
    as ``torch.save``); on leaving, it is fsynced and renamed to ``path``, or removed if the
    block raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp")
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        # mkstemp creates owner-only files; what lowcomm writes is plain shareable data.
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` atomically (see the module docstring)."""
    with atomic_path(path) as temporary, open(temporary, "wb") as handle:
        handle.write(payload)
        handle.flush()


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode())
