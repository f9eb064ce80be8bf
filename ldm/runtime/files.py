"""Files a command is told to write, written whole or not at all: into a temporary sibling, flushed, then renamed
over the target. A full disk or a killed process leaves the previous file (or none), never a truncated one that a
later command reads as damaged."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it (os.umask sets it to read it: another
    thread creating a file in that moment would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str, folder: bool = False, mask: int | None = None) -> None:
    """Give `path` the mode `mkdir` or `open` would have given it: `tempfile` makes its files and folders for their
    owner alone (0600 / 0700), and renamed into place they would stay unreadable to a teammate or a serving
    account. A folder keeps its setgid bit (a shared project folder's group passes on); a filesystem that refuses
    the change (some FUSE and CIFS mounts) leaves the mode as it is."""
    mask = umask() if mask is None else mask
    try:
        mode = os.stat(path).st_mode
        os.chmod(path, (0o777 & ~mask) | mode & 0o7000 if folder else (0o666 | mode & 0o111) & ~mask)
    except OSError:
        pass


def follow_umask_tree(folder: str) -> None:
    """`follow_umask` for `folder` and everything in it, before it is renamed into place: besides `tempfile`,
    safetensors writes its files for their owner alone too. Files linked from elsewhere (an upgrade keeps the
    original's files as hard links) keep the mode they have."""
    mask = umask()
    for root, _, files in os.walk(folder):
        follow_umask(root, folder=True, mask=mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path) and os.stat(path).st_nlink == 1:
                follow_umask(path, mask=mask)


def temporary_folder(parent: str, prefix: str) -> str:
    """A new empty folder in `parent` (`tempfile.mkdtemp`), with the mode `mkdir` gives."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    follow_umask(path, folder=True)
    return path


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Yields a file to fill (`mode` "wb" or "w"); on success it replaces `path`, on error it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    try:
        follow_umask(temp)
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


def read_json_object(path: str) -> dict:
    """The JSON object in `path`; {} for a file that is missing, unreadable, not JSON or not an object (a config a
    caller then treats as saying nothing)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
