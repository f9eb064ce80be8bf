"""Files a command is told to write, written whole or not at all: into a temporary sibling, flushed, then renamed
over the target. A full disk or a killed process leaves the previous file (or none), never a truncated one that a
later command reads as damaged."""

from __future__ import annotations

import contextlib
import os
import tempfile


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Yields a file to fill (`mode` "wb" or "w"); on success it replaces `path`, on error it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise


def save_image(image, path: str) -> None:
    """A PIL image to `path` (its format from the extension), atomically."""
    with atomic_write(path) as f:
        image.save(f, format=os.path.splitext(path)[1].lstrip(".").upper().replace("JPG", "JPEG") or "PNG")


def save_figure(figure, path: str, **options) -> None:
    """A matplotlib figure to `path` (its format from the extension), atomically."""
    with atomic_write(path) as f:
        figure.savefig(f, format=os.path.splitext(path)[1].lstrip(".") or "png", **options)
