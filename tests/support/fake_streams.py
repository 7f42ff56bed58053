"""A stand-in for the CUDA streams and events of offload ``block``'s ring (``block_streaming.CudaStreams``),
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
- A device buffer is being read by compute from the ``compute_waits`` on the event of the copy into it
  until the block has run. A side-stream copy into that buffer must come after a ``side_waits`` on a
  compute-stream event recorded after that read began (the ``done`` of the block that last read it);
  otherwise the copy could overwrite weights a queued kernel still reads: recorded in ``violations``.
- ``released(buffers)`` (the test calls it where the ring drops its device buffers) records the release:
  the side stream must have been synchronised since the last copy was queued, and no copy may be queued
  into a released buffer afterwards (it would write into memory the allocator handed out again); both
  are recorded in ``violations``. Released buffers are kept alive, so their addresses are not reused.

Compute-stream events are complete when recorded (the CPU computes synchronously).
"""

from __future__ import annotations

import threading

import torch


class FakeEvent:
    def __init__(self, n: int):
        self.n = n
        self.where = None  # "compute" or "side" once recorded
        self.seq = None  # the call number at which it was recorded


def _buffer(t) -> int:
    """The device buffer a view lies in (its storage)."""
    return t.untyped_storage().data_ptr()


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
        self._seq = 0
        self._ready_of = {}  # side event number -> device buffers whose copy it follows
        self._read_since = {}  # device buffer -> call number at which compute began reading it
        self._side_waited = -1  # the latest record number of a compute event the side stream waited for
        self._unsynced = 0  # copies queued since the last synchronize
        self._released = []  # device buffers dropped by the ring (kept alive)

    def event(self):
        with self._lock:
            self._events += 1
            return FakeEvent(self._events)

    def _tick(self) -> int:
        self._seq += 1
        return self._seq

    def record_compute(self, event):
        with self._lock:
            event.where, event.seq = "compute", self._tick()
            self.calls.append(("record_compute", event.n, None))

    def record_side(self, event):
        with self._lock:
            event.where, event.seq = "side", self._tick()
            for op in self._pending:
                if op.event is None:
                    op.event = event
                    self._ready_of.setdefault(event.n, []).append(_buffer(op.dst))
            self.calls.append(("record_side", event.n, None))

    def compute_waits(self, event):
        with self._lock:
            seq = self._tick()
            self.calls.append(("compute_waits", event.n, None))
            self._check_recorded(event, "compute_waits")
            for buf in self._ready_of.get(event.n, ()):
                self._read_since[buf] = seq  # compute reads this buffer from here on
            self._run_until(event, retire=False)

    def side_waits(self, event):
        with self._lock:
            self._tick()
            self.calls.append(("side_waits", event.n, None))
            self._check_recorded(event, "side_waits")
            if event.where == "compute":
                self._side_waited = max(self._side_waited, event.seq)

    def host_waits(self, event):
        with self._lock:
            self.calls.append(("host_waits", event.n, None))
            self._check_recorded(event, "host_waits")
            self._run_until(event, retire=True)

    def copy_on_side(self, dst, src):
        with self._lock:
            self._tick()
            buf = _buffer(dst)
            read = self._read_since.pop(buf, None)
            if read is not None and self._side_waited < read:
                self.violations.append("a side-stream copy into a device buffer did not wait for the block that last read it")
            if any(_buffer(b) == buf for b in self._released):
                self.violations.append("a side-stream copy into a device buffer that was already released")
            self._pending.append(_Copy(dst, src))
            self._unsynced += 1
            self.copy_threads.add(threading.current_thread().name)
            self.calls.append(("copy_on_side", None, src.untyped_storage().data_ptr()))

    def synchronize(self):
        with self._lock:
            self._tick()
            self.calls.append(("synchronize", None, None))
            for op in self._pending:
                self._retire(op)
            self._pending = []
            self._unsynced = 0

    def released(self, buffers):
        """The ring drops ``buffers`` (its device buffers) now."""
        with self._lock:
            self._tick()
            self.calls.append(("released", None, None))
            if self._unsynced:
                self.violations.append(f"device buffers released with {self._unsynced} side-stream copies not synchronised")
            self._released.extend(buffers)

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
