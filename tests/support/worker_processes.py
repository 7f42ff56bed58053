"""The worker processes of lingbot_core.parallel.workers as the kernel sees them (/proc), not as the pool says."""

from __future__ import annotations

import os
from pathlib import Path


def worker_pids(parent: int) -> set:
    """Live (not zombie) children of ``parent`` that run the worker module."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[1]) == parent and b"lingbot_core.parallel.workers" in cmdline:
            out.add(int(entry))
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rss_mib(pid) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")
