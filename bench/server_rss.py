"""RSS of a real ComfyUI server process while it runs one prompt: shared by the ``--server`` modes of
``bench.sequential_transient`` and ``bench.gguf``.

A thread polls the server's ``/proc/<pid>/status`` every 50 ms (VmRSS, RssAnon, RssFile); the server's
websocket ``executing`` events split the samples into stages. A prompt's row holds the RSS at its start,
the peak rise over it (VmHWM, reset at the start) and per stage the peak rise of the RSS and, at that
sample, of its anonymous and file-backed parts (MiB).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 ** 2
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def kib(field: str, pid="self") -> int:
    """One ``/proc/<pid>/status`` field, in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in STATUS_FIELDS:
                out[key] = int(line.split()[1]) * 1024
    return out


class Sampler(threading.Thread):
    """Polls a process's RSS (total, anonymous, file-backed) every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.period, self.samples = pid, period, []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.samples.append((time.monotonic(), status(self.pid)))
            self._stop_event.wait(self.period)

    def stop(self) -> list:
        self._stop_event.set()
        self.join()
        return self.samples


def stage_peaks(samples: list, events: list, roles: dict, start: dict) -> dict:
    """Per stage (the node ComfyUI announced last before a sample): the sample with the highest RSS,
    as rises over ``start`` of the RSS and of its anonymous and file-backed parts (MiB)."""
    marks = [(e["t"], roles.get(str(e["data"]["node"]), str(e["data"]["node"])))
             for e in events if e.get("type") == "executing" and isinstance(e.get("data"), dict)
             and e["data"].get("node") is not None]
    out: dict = {}
    for t, st in samples:
        stage = "before" if not marks or t < marks[0][0] else [r for m, r in marks if m <= t][-1]
        if stage not in out or st["VmRSS"] > out[stage]["_rss"]:
            out[stage] = {"_rss": st["VmRSS"], **{f: round((st[f] - start[f]) / MIB) for f in STATUS_FIELDS}}
    return {k: {f: v[f] for f in STATUS_FIELDS} for k, v in out.items()}


def measure_prompt(server, graph: dict, roles: dict, timeout: float = 900) -> dict:
    """Free the server's models, run ``graph`` and return its RSS row (``roles``: node id -> stage name)."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.memory_graphs import free_all, reset_peak

    pid = server.proc.pid
    free_all(server)
    reset_peak(pid)
    start = status(pid)
    sampler = Sampler(pid)
    sampler.start()
    t0 = time.perf_counter()
    try:
        entry = server.run(graph, timeout=timeout)
    finally:
        samples = sampler.stop()
    seconds = time.perf_counter() - t0
    hwm = kib("VmHWM", pid)
    peak = max(samples, key=lambda s: s[1]["VmRSS"])[1] if samples else start
    return {"status": entry["status"]["status_str"], "seconds": round(seconds, 1),
            "start_mib": round(start["VmRSS"] / MIB), "start_anon_mib": round(start["RssAnon"] / MIB),
            "start_file_mib": round(start["RssFile"] / MIB),
            "peak_rise_mib": round((hwm - start["VmRSS"]) / MIB),
            "peak_sample": {f: round((peak[f] - start[f]) / MIB) for f in STATUS_FIELDS},
            "samples": len(samples), "stages": stage_peaks(samples, entry.get("ws_events") or [], roles, start)}
