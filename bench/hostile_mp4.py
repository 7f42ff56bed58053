"""Peak RSS of opening forged mp4s (issue 51): FFmpeg's mp4 demuxer as main opened a server's answer
(forced format, no box pre-parse) against ``video_io.read_mp4`` (boxes checked first). Each read runs in a
child process of its own (VmHWM reset to VmRSS first); the old opener only opens the file, as main did
before its header checks.

    .venv/bin/python -m bench.hostile_mp4            # the three bombs, old and new
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import io, json, sys, types
# lingbot_core.files alone: the package's __init__ would import the model stack (seconds, not measured)
sys.modules["lingbot_core"] = types.ModuleType("lingbot_core")
sys.modules["lingbot_core"].__path__ = ["lingbot_core"]
import av
from lingbot_core.files.video_io import read_mp4

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

OLD = {"format_whitelist": "mov,mp4,m4a,3gp,3g2,mj2", "enable_drefs": "0", "use_absolute_path": "0",
       "protocol_whitelist": "none"}
rows = {}
for name in sys.argv[2:]:
    data = open(name, "rb").read()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    try:
        if sys.argv[1] == "old":
            with av.open(io.BytesIO(data), format="mp4", container_options=OLD,
                         options={"max_pixels": str(2 * 96 * 64)}) as c:
                outcome = f"opened: {c.streams.video[0].frames:,} frames in the header"
        else:
            read_mp4(data, frames=5, height=64, width=96)
            outcome = "read"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    rows[name] = {"rise": kib("VmHWM") - before, "outcome": outcome}
print(json.dumps(rows))
"""


def measure(paths, mode: str = "new", timeout: float = 600) -> dict:
    """``{path: {"rise": peak RSS rise in bytes, "outcome": what happened}}`` of reading each file once in one
    child process: ``new`` with read_mp4 for 5 frames of 96x64, ``old`` with main's opener (av.open only)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, *map(str, paths)], capture_output=True, text=True,
                         cwd=REPO, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} reader's child failed (exit {out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main() -> None:
    sys.path[:0] = [str(REPO / "tests"), str(REPO)]
    from support import mp4_forge as forge

    bombs = {"sample table, 85 M samples": forge.index_bomb(85_000_000),
             "edit list, 100 k entries over 1,000 samples": forge.edit_bomb(100_000),
             "fragment trun, 85 M samples": forge.trun_bomb(85_000_000)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in bombs.items():
            path = Path(tmp) / "bomb.mp4"
            path.write_bytes(data)
            for mode in ("old", "new"):  # one child each: the old opener's RSS must not count against the new
                row = measure([path], mode)[str(path)]
                print(f"{name} ({len(data):,} bytes), {mode}: +{row['rise'] / 2**20:.1f} MiB; {row['outcome']}")

if __name__ == "__main__":
    main()
