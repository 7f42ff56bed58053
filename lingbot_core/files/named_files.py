"""Files a stranger names (a workflow's widget, a command-line flag): where such a file may be, and how a
text file is read. One owner for both rules, so every node and the command line refuse the same things.

* :func:`inside` -- a name chosen from a folder's listing resolves, links and all, to a file inside that
  folder (a link in ComfyUI's ``input/`` to ``~/.ssh/id_rsa`` is refused, not read).
* :func:`read_text_file` -- a regular file only (no folder, FIFO or device: ``/dev/zero`` would read until
  memory runs out, a FIFO would block), its size checked by ``fstat`` on the opened file before a byte is
  read, then a read bounded by that limit (a file that grows meanwhile is still cut off).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePath

# A rewriter caption is a few kB and the text encoder reads at most ~38 k tokens (~150 kB); a system
# prompt module ~50 kB. Nothing a prompt needs comes near this.
MAX_TEXT_FILE_BYTES = 4 * 1024 * 1024

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def inside(root, name: str, what: str = "file") -> Path:
    """The real path of ``name`` (relative, '/'-separated) under the folder ``root``, refused (ValueError)
    when it is absolute, climbs with '..', or leads outside ``root`` through a link."""
    parts = PurePath(name).parts
    if not name or "\0" in name or os.path.isabs(name) or ".." in parts or name.startswith(("/", "\\")):
        raise ValueError(f"{what} {name!r} is not a name inside {root}; paths are not accepted.")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.commonpath([real_root, real]) != real_root:
        raise ValueError(f"{what} {name!r} leads outside {root} through a link; only files inside the folder are "
                         "read. Copy the file into the folder instead of linking it.")
    return Path(real)


def read_text_file(path, *, max_bytes: int = MAX_TEXT_FILE_BYTES, what: str = "a prompt file") -> bytes:
    """The bytes of the regular file ``path`` (at most ``max_bytes``); ValueError naming the file when it is
    missing, not a regular file, or larger, checked before anything is read."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)  # a FIFO opens without waiting
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; {what} is expected there.") from None
    except (IsADirectoryError, PermissionError):
        if path.is_dir():  # Windows refuses to open a folder
            raise ValueError(f"{path} is a folder, not {what}.") from None
        raise
    try:
        info = os.fstat(fd)
        for test, kind in _KINDS:
            if test(info.st_mode):
                raise ValueError(f"{path} is {kind}, not {what}; only a regular file is read.")
        if info.st_size > max_bytes:
            raise ValueError(f"{path} is {info.st_size:,} bytes; {what} is at most {max_bytes >> 20} MiB, so it is not "
                             "read.")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ValueError(f"{path} grew past {max_bytes >> 20} MiB while it was read; it is not {what}.")
    return data
