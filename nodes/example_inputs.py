"""The example workflows' input files, placed in ComfyUI's input folder when the pack loads.

Four examples load ``lingbot_example_input.png`` with ComfyUI's Load Image and two load
``lingbot_example_input.mp4`` with Load Video; both nodes only offer files in the input folder, so a
template opened on a fresh install would stop at "Invalid image file". The files ship in
``example_workflows/`` and are copied to ``folder_paths.get_input_directory()`` when missing: a file of
that name already there (the user's own, or an earlier copy) is never replaced, and a failed copy only
logs one line (the pack still loads; the user can upload the file by hand). The examples keep ComfyUI's
own Load Image / Load Video, so switching to the user's picture is the usual upload.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Tuple

EXAMPLES = Path(__file__).resolve().parents[1] / "example_workflows"
FILES = ("lingbot_example_input.png", "lingbot_example_input.mp4")
MAX_BYTES = 1 << 20  # the shipped files are tens of KB; anything bigger is not ours to copy

log = logging.getLogger("lingbot_video")


def place(input_dir: str | os.PathLike, files=FILES, source: Path = EXAMPLES) -> Tuple[List[str], List[str]]:
    """Copy each of ``files`` from ``source`` into ``input_dir`` unless a file of that name exists.

    Returns (copied names, "name: reason" for each one that could not be copied). Never raises for an
    I/O problem, never overwrites: the destination is created exclusively (``open(..., "xb")``).
    """
    copied, failed = [], []
    for name in files:
        dest = Path(input_dir) / name
        try:
            if dest.exists() or dest.is_symlink():
                continue
            data = (source / name).read_bytes()
            if len(data) > MAX_BYTES:
                raise ValueError(f"{len(data)} bytes, more than the {MAX_BYTES} an example input may have")
            Path(input_dir).mkdir(parents=True, exist_ok=True)
            if _write_new(dest, data):
                copied.append(name)
        except (OSError, ValueError) as e:
            failed.append(f"{name}: {e}")
    return copied, failed


def _write_new(dest: Path, data: bytes) -> bool:
    """Create ``dest`` with ``data``; False when it exists (made meanwhile by another process: theirs stays)."""
    try:
        f = open(dest, "xb")
    except FileExistsError:
        return False
    with f:
        try:
            f.write(data)
        except BaseException:
            f.close()
            dest.unlink(missing_ok=True)  # no half-written file that would block the next try
            raise
    return True


def place_in_comfy_input() -> None:
    """:func:`place` into ComfyUI's input folder, one log line; never fails the pack's import."""
    try:
        import folder_paths

        input_dir = folder_paths.get_input_directory()
        copied, failed = place(input_dir)
    except Exception as e:  # noqa: BLE001 - a missing example file must not cost the user the pack
        log.warning("lingbot-video: could not place the example inputs (%s); upload them from %s by hand", e, EXAMPLES)
        return
    if failed:
        log.warning("lingbot-video: could not copy example inputs to %s (%s); upload them from %s by hand",
                    input_dir, "; ".join(failed), EXAMPLES)
    elif copied:
        log.info("lingbot-video: copied the example inputs %s to %s (for the example workflows)",
                 ", ".join(copied), input_dir)
