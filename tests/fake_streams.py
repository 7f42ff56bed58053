"""A stand-in for the CUDA streams and events of offload ``block``'s ring (``offload.CudaStreams``),
for CPU-only tests on the fake device: every call is recorded in order, and the side stream's copies
behave as asynchronously as CUDA allows, so a missing wait changes numbers or is reported.

- ``copy_on_side(dst, src)`` queues the copy and remembers what ``src`` held then. The copy lands in
  ``dst`` only when something waits for an event recorded after it: the compute stream
  (``compute_waits``), the host (``host_waits``) or a ``synchronize``. A block whose copy nobody
  waited for computes on whatever the device buffer held before (wrong weights, wrong frames).
- The host may assume a copy out of a staging buffer has *finished* only after ``host_waits`` on its
  event (a compute-stream wait is a GPU-side wait: the host learns nothing from it). When a copy is
  retired that way, or at ``synchronize``, its source must still hold what it held when the copy was
  queued; otherwise the staging buffer was refilled while the copy was in flight, which is recorded
  in ``violations`` (and the copy delivers the new bytes, as a real GPU would).
- Waiting on an event that was never recorded is a no-op in CUDA; it is recorded in ``violations``.

Compute-stream events are complete when recorded (the CPU computes synchronously).
"""

from __future__ import annotations

import threading

import torch


class FakeEvent:
    def __init__(self, n: int):
        self.n = n
        self.where = None  # "compute" or "side" once recorded


class _Copy:
    def __init__(self, dst, src):
        self.dst, self.src, self.snapshot = dst, src, src.clone()
        self.event = None  # the first side-stream event recorded after this copy
        self.landed = False


class RecordingStreams:
    def __init__(self):
        self.calls = []  # (call, event number or None, staging buffer address or None)
        self.violations = []
        self._pending = []
        self._lock = threading.RLock()
        self._events = 0
        self.copy_threads = set()  # names of the threads that queued the copies

    def event(self):
        with self._lock:
            self._events += 1
            return FakeEvent(self._events)

    def record_compute(self, event):
        with self._lock:
            event.where = "compute"
            self.calls.append(("record_compute", event.n, None))

    def record_side(self, event):
        with self._lock:
            event.where = "side"
            for op in self._pending:
                if op.event is None:
                    op.event = event
            self.calls.append(("record_side", event.n, None))

    def compute_waits(self, event):
        with self._lock:
            self.calls.append(("compute_waits", event.n, None))
            self._check_recorded(event, "compute_waits")
            self._run_until(event, retire=False)

    def side_waits(self, event):
        with self._lock:
            self.calls.append(("side_waits", event.n, None))
            self._check_recorded(event, "side_waits")

    def host_waits(self, event):
        with self._lock:
            self.calls.append(("host_waits", event.n, None))
            self._check_recorded(event, "host_waits")
            self._run_until(event, retire=True)

    def copy_on_side(self, dst, src):
        with self._lock:
            self._pending.append(_Copy(dst, src))
            self.copy_threads.add(threading.current_thread().name)
            self.calls.append(("copy_on_side", None, src.untyped_storage().data_ptr()))

    def synchronize(self):
        with self._lock:
            self.calls.append(("synchronize", None, None))
            for op in self._pending:
                self._retire(op)
            self._pending = []

    # -- the simulated side stream ----------------------------------------------------------------

    def _check_recorded(self, event, call):
        if event.where is None:
            self.violations.append(f"{call} on event {event.n}, which was never recorded")

    def _run_until(self, event, retire: bool):
        if event.where != "side":
            return
        upto = [i for i, op in enumerate(self._pending) if op.event is event]
        if not upto:
            return
        for op in self._pending[:upto[-1] + 1]:
            self._land(op)
            if retire:
                self._retire(op)
        if retire:
            self._pending = self._pending[upto[-1] + 1:]

    def _land(self, op):
        if not op.landed:
            op.dst.copy_(op.snapshot)
            op.landed = True

    def _retire(self, op):
        if not torch.equal(op.src, op.snapshot):
            self.violations.append("a staging buffer was refilled while its copy to the device was in flight")
            op.dst.copy_(op.src)  # what the GPU would have read
            op.landed = True
        self._land(op)
