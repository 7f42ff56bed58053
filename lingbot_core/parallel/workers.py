"""One worker process per device holding one parallel pipeline: spawn, serve requests, cancel, stop.

A :class:`WorkerPool` starts ``world_size`` ranks, each a fresh ``python`` running :func:`serve`. Every
rank loads the pipeline with the same loader arguments on its own device, joins the process group and
parallelizes it (:mod:`lingbot_core.parallel.runtime`), then answers requests: the parent sends the same
call (``generate``, ``refine``, ``decode``, ``set_offload``...) to every rank, every rank runs it, and
rank 0's result comes back. Rank 0 also forwards each sampling step (index, count, x0) so the host can
show progress and previews.

Why processes started with ``subprocess`` and not ``torch.multiprocessing`` (spawn): a spawned child
re-runs the parent's ``__main__`` file (ComfyUI's ``main.py``: argument parsing, logging set-up) and
unpickles its target by module name, and ComfyUI imports a custom-node pack under a name made from its
path, which no child can import. A worker here is ``python -c`` importing ``lingbot_core`` from the
pack's root, connected by a socket pair it inherits; only plain values and tensors cross (pickled),
never the pack's classes (see :class:`Wire`).

Bounded everywhere:

- start: every rank must report ready within ``start_timeout_s`` (and a rank that dies or fails to load
  ends the start at once, with its error);
- collectives: the process group's timeout (``collective_timeout_s``) makes a rank whose peer is gone
  fail instead of hanging;
- a rank that dies is seen at once (its process sentinel), the others are killed, and the error names
  the rank and its exit; a rank's exception ends the request with ONE error (rank, type, message), and
  when the other ranks do not answer within ``error_grace_s`` (stuck in a collective) the pool is stopped;
- orphans: each worker watches a lifeline pipe whose only writer is the parent; when the parent dies,
  however it dies, the pipe closes and the worker exits (:func:`_watch_lifeline`).

Cancel is one decision for all ranks: the parent writes the cancelled request's number into a shared
flag file, and at every sampling step each rank reads it and the ranks all-reduce (MAX) what they read
over a CPU (gloo) group, so every rank stops at the same step and the group stays usable.

Two pools may not hold one device (:func:`claim_devices`): the second start is refused, naming the
first pool's label.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .plan import ParallelPlan

logger = logging.getLogger("lingbot_core")

#: The pack's root (the directory holding ``lingbot_core``): put on the workers' ``PYTHONPATH``.
PACK_ROOT = Path(__file__).resolve().parents[2]

_FLAG = struct.Struct("<q")  # the cancelled request's number, in the shared flag file
_LIFELINE_EXIT = 70  # a worker's exit status when its parent is gone


class WorkerError(RuntimeError):
    """A worker rank failed or died; the message names the rank, its device and what happened."""


class DevicesBusyError(RuntimeError):
    """Another worker pool already holds one of the devices asked for."""


class Cancelled(Exception):
    """Raised on every rank at the same step when the host cancelled the request."""


# -- which pool holds which device (bounded: one entry per device of a running pool) ---------------------

_CLAIMS: Dict[str, str] = {}
_CLAIMS_LOCK = threading.Lock()


def claim_devices(devices: Sequence[str], label: str) -> None:
    """Reserve ``devices`` for the pool ``label``; refuse (naming the holder) if another pool has one.
    CPU "devices" are never exclusive (test and CPU-only set-ups)."""
    wanted = [d for d in devices if not d.startswith("cpu")]
    with _CLAIMS_LOCK:
        held = {d: _CLAIMS[d] for d in wanted if d in _CLAIMS and _CLAIMS[d] != label}
        if held:
            holders = sorted(set(held.values()))
            raise DevicesBusyError(
                f"{', '.join(sorted(held))} {'is' if len(held) == 1 else 'are'} held by the worker processes of "
                f"{' and '.join(repr(h) for h in holders)}; {label!r} cannot use {'it' if len(held) == 1 else 'them'} too. "
                "Put an 'LingBot-Video Unload Pipeline' after the last node that uses that pipeline, or give this "
                "loader other GPUs in its Multi-GPU node.")
        for d in wanted:
            _CLAIMS[d] = label


def release_devices(devices: Sequence[str], label: str) -> None:
    with _CLAIMS_LOCK:
        for d in devices:
            if _CLAIMS.get(d) == label:
                del _CLAIMS[d]


# -- values that cross the process boundary -----------------------------------------------------------

_IMAGE_CONDITION = "lingbot.ImageCondition"
_TENSOR_FILE = "lingbot.TensorFile"
#: Tensors from this size cross as files in the pool's private folder, mapped by the receiver: pickling a
#: tensor copies it through torch's serializer (a 5 s 480p video's 553 MiB of frames: 20 s, against 2.6 s).
SHARE_BYTES = 1 << 20


class Wire:
    """What crosses between the processes: plain values and tensors, never the pack's classes (each process
    imports the pack under its own module name), so an ``ImageCondition`` crosses as its two tensors; tensors
    of :data:`SHARE_BYTES` or more cross as files named ``prefix-N.bin`` in ``folder`` (the pool's private one).
    The parent deletes every file once read (results, steps) or once the request is answered (arguments)."""

    def __init__(self, folder: str, prefix: str):
        self.folder, self.prefix = folder, prefix
        self._count = 0
        self.written: List[str] = []

    def pack(self, value):
        import torch

        from .. import ImageCondition

        if isinstance(value, ImageCondition):
            return (_IMAGE_CONDITION, self.pack(value.posterior.moments), self.pack(value.pixels))
        if isinstance(value, torch.Tensor) and value.numel() * value.element_size() >= SHARE_BYTES:
            return self._to_file(value)
        if isinstance(value, dict):
            return {k: self.pack(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not _is_tag(value):
            return type(value)(self.pack(v) for v in value)
        return value

    def _to_file(self, tensor):
        import torch

        flat = tensor.detach().to("cpu").contiguous().view(-1)
        self._count += 1
        path = os.path.join(self.folder, f"{self.prefix}-{self._count}.bin")
        with open(path, "wb") as f:
            f.write(memoryview(flat.view(torch.uint8).numpy()))
        self.written.append(path)
        return (_TENSOR_FILE, path, str(flat.dtype).replace("torch.", ""), tuple(tensor.shape))

    def unpack(self, value, delete: bool):
        """``value`` as sent; ``delete``: remove each tensor file once mapped (the mapping stays valid)."""
        import torch

        from ..model.latents import Posterior
        from .. import ImageCondition

        if _is_tag(value) and value[0] == _IMAGE_CONDITION:
            return ImageCondition(Posterior(self.unpack(value[1], delete)), self.unpack(value[2], delete))
        if _is_tag(value):
            _, path, dtype, shape = value
            if os.path.dirname(path) != self.folder:
                raise WorkerError(f"a worker sent a tensor file outside the pool's folder: {path}")
            count = 1
            for n in shape:
                count *= n
            tensor = torch.from_file(path, shared=False, size=count, dtype=getattr(torch, dtype)).view(shape)
            if delete:
                os.unlink(path)
            return tensor
        if isinstance(value, dict):
            return {k: self.unpack(v, delete) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.unpack(v, delete) for v in value)
        return value

    def forget(self) -> None:
        """Delete the files this side wrote (the parent, once every rank has answered)."""
        for path in self.written:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.written.clear()


def _is_tag(value) -> bool:
    return isinstance(value, tuple) and len(value) > 0 and value[0] in (_IMAGE_CONDITION, _TENSOR_FILE)


def _shared_folder() -> Optional[str]:
    """/dev/shm where it is a roomy tmpfs (files there are memory: no disk writeback), else the temp folder."""
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stats.f_bavail * stats.f_frsize >= 4 << 30 else None


def _send(conn: Connection, message) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())


def _error_line(error: BaseException) -> tuple:
    return ("error", type(error).__name__, str(error) or repr(error))


# -- the parent's side -----------------------------------------------------------------------------------

class WorkerPool:
    """``len(devices)`` worker ranks serving one pipeline; see the module docstring.

    ``load``: keyword arguments of :func:`lingbot_core.load_pipeline` (plain values; ``device`` is each
    rank's own). ``plan``: the :class:`~lingbot_core.parallel.plan.ParallelPlan`'s fields as a dict; its
    world size must be ``len(devices)``. ``devices``: ``cuda:N`` each (in this process's numbering), or
    ``cpu`` for every rank (gloo; CPU-only machines and tests).
    ``threads``: CPU threads per rank (default: the CPUs divided among the ranks).
    """

    def __init__(self, load: dict, devices: Sequence[str], plan: dict, *, label: str = "pipeline",
                 backend: Optional[str] = None, start_timeout_s: float = 900.0, collective_timeout_s: float = 600.0,
                 error_grace_s: float = 10.0, stop_timeout_s: float = 20.0, threads: Optional[int] = None):
        if len(devices) < 1:
            raise ValueError("a worker pool needs at least one device.")
        self.load = dict(load)
        self.devices = [str(d) for d in devices]
        self.plan = dict(plan)
        world = ParallelPlan(**self.plan).world_size
        if world != len(self.devices):
            raise ValueError(f"the plan has {world} ranks but {len(self.devices)} devices were given "
                             f"({', '.join(self.devices)}); give one device per rank.")
        cpu = [d.startswith("cpu") for d in self.devices]
        if any(cpu) and not all(cpu):
            raise ValueError(f"devices {', '.join(self.devices)} mix the CPU and GPUs; use GPUs only, or the CPU only.")
        self.label = label
        self.backend = backend or ("nccl" if self.devices[0].startswith("cuda") else "gloo")
        self.start_timeout_s = start_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.error_grace_s = error_grace_s
        self.stop_timeout_s = stop_timeout_s
        self.threads = threads or max(1, (os.cpu_count() or 1) // len(self.devices))
        self._procs: List[subprocess.Popen] = []
        self._conns: List[Connection] = []
        self._lifeline: Optional[int] = None
        self._dir: Optional[str] = None
        self._wire: Optional[Wire] = None
        self._flag: Optional[mmap.mmap] = None
        self._seq = 0
        self._lock = threading.RLock()
        self.ready_info: List[dict] = []  # per rank: pid, RSS after loading, seconds to load
        self.last_stats: dict = {}  # rank 0's RSS and device bytes after the last request
        self.rss: List[int] = []  # every rank's RSS after the last request
        self.steps_run = 0  # sampling steps rank 0 reported in the last request (where a cancel stopped it)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def running(self) -> bool:
        return bool(self._procs)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self._procs]

    # -- start ------------------------------------------------------------------------------------------

    def start(self, interrupt: Optional[Callable[[], None]] = None) -> None:
        """Spawn the ranks and wait until every one has loaded its pipeline (or raise, leaving nothing).
        ``interrupt`` (the host's cancel check, which raises) is polled while they load: a cancel kills them."""
        with self._lock:
            if self._procs:
                return
            claim_devices(self.devices, self.label)
            try:
                self._spawn()
                self._await_ready(interrupt)
            except BaseException:
                self._kill_all()
                raise

    def _spawn(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="lingbot-workers-", dir=_shared_folder())  # 0700: private
        self._wire = Wire(self._dir, "p")
        flag_path = os.path.join(self._dir, "cancel")
        with open(flag_path, "wb") as f:
            f.write(_FLAG.pack(-1))
        fd = os.open(flag_path, os.O_RDWR)
        try:
            self._flag = mmap.mmap(fd, _FLAG.size)
        finally:
            os.close(fd)
        read_end, self._lifeline = os.pipe()
        env = self._environment()
        code = "import sys; from lingbot_core.parallel.workers import main; main(int(sys.argv[1]), int(sys.argv[2]))"
        try:
            for rank in range(self.world_size):
                parent_sock, child_sock = socket.socketpair()
                try:
                    proc = subprocess.Popen([sys.executable, "-c", code, str(child_sock.fileno()), str(read_end)],
                                            pass_fds=(child_sock.fileno(), read_end), cwd=self._dir,
                                            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                            stdin=subprocess.DEVNULL)
                finally:
                    child_sock.close()
                self._procs.append(proc)
                conn = Connection(parent_sock.detach())
                self._conns.append(conn)
                _send(conn, self._setup(rank, flag_path))
        finally:
            os.close(read_end)

    def _environment(self) -> dict:
        """What every rank's environment adds: the pack on ``PYTHONPATH``, the rendezvous (torchrun's
        variables, on 127.0.0.1) and the rank's GPUs made visible as ``cuda:0..N-1`` (LOCAL_RANK = rank)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(PACK_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env.update(WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   OMP_NUM_THREADS=str(self.threads))
        if not self.devices[0].startswith("cpu"):
            visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            index = [int(d.split(":")[1]) if ":" in d else 0 for d in self.devices]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if i < len(visible) else str(i) for i in index)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: gloo on the CPU whatever the machine has
        return env

    def _setup(self, rank: int, flag_path: str) -> dict:
        return {"rank": rank, "load": self.load, "plan": self.plan, "backend": self.backend, "flag": flag_path,
                "collective_timeout_s": self.collective_timeout_s, "threads": self.threads}

    def _await_ready(self, interrupt) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        ready: Dict[int, dict] = {}
        while len(ready) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [r for r in range(self.world_size) if r not in ready]
                raise WorkerError(f"{self.label}: worker rank(s) {waiting} did not load the pipeline within "
                                  f"{self.start_timeout_s:.0f} s; the workers were stopped.")
            for rank, message in self._next_messages(min(left, 0.5)):
                if message[0] == "error":
                    raise WorkerError(f"{self.label}: worker rank {rank} ({self.devices[rank]}) could not start: "
                                      f"{message[1]}: {message[2]}")
                if message[0] == "ready":
                    ready[rank] = message[1]
            if interrupt is not None:
                interrupt()
        self.ready_info = [ready[r] for r in range(self.world_size)]

    def _next_messages(self, timeout: float):
        """(rank, message) for every message that arrives within ``timeout``; raises WorkerError at once
        (after killing every rank) when a rank's process has ended."""
        by_conn = {c: r for r, c in enumerate(self._conns)}
        out = []
        for conn in wait(list(by_conn), timeout):
            rank = by_conn[conn]
            try:
                out.append((rank, _recv(conn)))
            except (EOFError, OSError):
                self._died(rank)
        if not out:
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self._died(rank)
        return out

    def _died(self, rank: int) -> None:
        proc = self._procs[rank]
        try:
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "closed its connection"
        elif code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        self._kill_all()
        raise WorkerError(f"{self.label}: worker rank {rank} ({self.devices[rank]}, pid {proc.pid}) {how}; all "
                          "workers were stopped. The pipeline starts its workers again when next used.")

    # -- requests ---------------------------------------------------------------------------------------

    def call(self, method: str, *args, callback: Optional[Callable] = None, **kwargs):
        """Run ``pipe.method(*args, **kwargs)`` on every rank and return rank 0's result.

        ``callback(step, steps, x0)``, if given, is called in this process with rank 0's steps; if it raises
        (the host's cancel), every rank stops at the same later step and that exception is raised here once
        they have. Its ``interrupt()`` attribute, if any, is polled while waiting, with the same effect."""
        with self._lock:
            self.start(getattr(callback, "interrupt", None))
            self._seq += 1
            seq = self._seq
            forward = {"steps": callback is not None, "status": getattr(callback, "status", None) is not None}
            try:
                payload = self._wire.pack((method, args, kwargs))
                for conn in self._conns:
                    _send(conn, ("call", seq, payload, forward))
            except OSError as e:
                self._kill_all()
                raise WorkerError(f"{self.label}: the request could not reach the workers ({e}); they were stopped "
                                  "and start again when next used.") from None
            try:
                return self._collect(seq, callback)
            finally:
                if self._wire is not None:
                    self._wire.forget()

    def _collect(self, seq: int, callback):
        replies: Dict[int, tuple] = {}
        first_error = None  # (rank, type, message), in order of arrival
        host_error: Optional[BaseException] = None
        error_deadline = None
        poll = getattr(callback, "interrupt", None)
        self.steps_run = 0
        while len(replies) < self.world_size:
            for rank, message in self._next_messages(0.1):
                kind = message[0]
                if kind == "step":
                    self.steps_run += 1
                    x0 = self._wire.unpack(message[3], delete=True)
                if kind == "step" and host_error is None and callback is not None:
                    try:
                        callback(message[1], message[2], x0)
                    except BaseException as e:  # the host's cancel (or a failing preview): stop every rank
                        host_error = self._cancel(seq, e)
                elif kind == "status" and callback is not None and host_error is None:
                    callback.status(message[1])
                elif kind in ("ok", "error", "cancelled"):
                    replies[rank] = message
                    if kind == "error" and first_error is None:
                        first_error = (rank, message[1], message[2])
                        error_deadline = time.monotonic() + self.error_grace_s
            if poll is not None and host_error is None:
                try:
                    poll()
                except BaseException as e:
                    host_error = self._cancel(seq, e)
            if error_deadline is not None and time.monotonic() > error_deadline and len(replies) < self.world_size:
                self._kill_all()  # the others wait in a collective for the failed rank: the group is lost
                rank, kind, text = first_error
                raise WorkerError(f"{self.label}: worker rank {rank} ({self.devices[rank]}) failed: {kind}: {text} "
                                  "(the other ranks were stopped; the workers start again when next used).")
        # rank 0's answer is read (its files deleted) also when an error or a cancel is raised instead
        result = self._wire.unpack(replies[0][1], delete=True) if replies[0][0] == "ok" else None
        if first_error is not None:
            rank, kind, text = first_error
            if kind == "ValueError" and all(m[0] == "error" and m[2] == text for m in replies.values()):
                raise ValueError(text)  # bad input, refused alike by every rank: the single-process error
            raise WorkerError(f"{self.label}: worker rank {rank} ({self.devices[rank]}) failed: {kind}: {text}")
        if host_error is not None:
            raise host_error
        if any(m[0] == "cancelled" for m in replies.values()):
            raise WorkerError(f"{self.label}: the workers stopped a request nobody cancelled.")
        self.last_stats = replies[0][2]
        self.rss = [replies[r][2]["rss"] for r in range(self.world_size)]
        return result

    def _cancel(self, seq: int, error: BaseException) -> BaseException:
        if self._flag is not None:
            self._flag[:_FLAG.size] = _FLAG.pack(seq)
        return error

    # -- stop -------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every rank to free its pipeline and exit; kill those still there after ``stop_timeout_s``."""
        with self._lock:
            if not self._procs:
                return
            for conn in self._conns:
                try:
                    _send(conn, ("stop",))
                except OSError:
                    pass
            deadline = time.monotonic() + self.stop_timeout_s
            for proc in self._procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self._kill_all()

    def _kill_all(self) -> None:
        """Kill what is left, reap every rank, close every handle and delete the private directory."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL did not end
                logger.warning("LingBot-Video: worker pid %d did not exit after SIGKILL.", proc.pid)
        for conn in self._conns:
            conn.close()
        if self._lifeline is not None:
            os.close(self._lifeline)
        if self._flag is not None:
            self._flag.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._conns, self._lifeline, self._flag, self._dir, self._wire = [], [], None, None, None, None
        release_devices(self.devices, self.label)

    def __del__(self):  # a pool dropped without stop(): its workers see the lifeline close and exit
        if getattr(self, "_procs", None):
            self._kill_all()


# -- the worker's side -----------------------------------------------------------------------------------

def _watch_lifeline(fd: int, folder: str) -> None:
    """Exit this process as soon as the parent is gone (its end of the pipe closes: EOF), deleting the pool's
    private ``folder`` (the cancel flag, tensor files in flight), which the dead parent can no longer delete."""
    def watch():
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(_LIFELINE_EXIT)

    threading.Thread(target=watch, name="lingbot-lifeline", daemon=True).start()


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (rank 0's store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Rank:
    """One rank's pipeline and its process group (see :func:`serve`)."""

    def __init__(self, setup: dict, conn: Connection):
        self.setup = setup
        self.conn = conn
        self.rank = setup["rank"]
        self.wire = Wire(os.path.dirname(setup["flag"]), f"r{self.rank}")
        self.pipe = None
        self.ctx = None  # lingbot_core.parallel.runtime's context, once the group is up
        fd = os.open(setup["flag"], os.O_RDONLY)
        try:
            self.flag = mmap.mmap(fd, _FLAG.size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def start(self) -> None:
        import torch

        from .. import load_pipeline
        from .plan import ParallelPlan
        from .runtime import init_distributed, parallelize

        setup = self.setup
        torch.set_num_threads(setup["threads"])
        plan = ParallelPlan(**setup["plan"])
        self.ctx = init_distributed(plan, backend=setup["backend"], timeout_s=setup["collective_timeout_s"])
        self.pipe = load_pipeline(device=self.ctx.device, **setup["load"])
        parallelize(self.pipe, self.ctx)

    def cancelled(self, seq: int) -> bool:
        """The ranks' common answer: did the host cancel request ``seq``? (every rank calls it at the same step)"""
        return bool(self.ctx.any_rank(_FLAG.unpack(self.flag[:_FLAG.size])[0] == seq))

    def step_callback(self, seq: int, forward: dict):
        def callback(step, steps, x0):
            if self.cancelled(seq):
                raise Cancelled()
            if self.rank == 0 and forward["steps"]:
                x0 = x0.detach().to("cpu", copy=True)
                _send(self.conn, ("step", step, steps, self.wire.pack(x0)))

        if self.rank == 0 and forward["status"]:
            callback.status = lambda text: _send(self.conn, ("status", str(text)))
        return callback

    def run(self, seq: int, payload, forward: dict):
        method, args, kwargs = self.wire.unpack(payload, delete=False)  # the parent deletes its files
        self.wire.written.clear()  # and the files this rank sends
        if method.startswith("_") or not callable(getattr(self.pipe, method, None)):
            raise ValueError(f"a worker pipeline has no method {method!r}.")
        if method in ("generate", "refine", "denoise"):
            kwargs["callback"] = self.step_callback(seq, forward)
        result = getattr(self.pipe, method)(*args, **kwargs)
        return self.wire.pack(result) if self.rank == 0 else None

    def close(self) -> None:
        from .runtime import shutdown

        if self.pipe is not None:
            self.pipe.release()
            self.pipe = None
        shutdown()


def serve(conn_fd: int, lifeline_fd: int) -> int:
    """A worker rank's main loop (run by :class:`WorkerPool` as ``python -c``): set up, then answer
    requests until told to stop or the parent is gone."""
    conn = Connection(conn_fd)
    setup = _recv(conn)  # a parent gone before sending it closes the socket: EOFError ends this process
    _watch_lifeline(lifeline_fd, os.path.dirname(setup["flag"]))
    logging.basicConfig(level=logging.WARNING, format=f"[lingbot worker rank {setup['rank']}] %(levelname)s %(message)s")
    rank = _Rank(setup, conn)
    started = time.monotonic()
    try:
        rank.start()
    except BaseException as e:
        _send(conn, _error_line(e))
        return 1
    _send(conn, ("ready", {"pid": os.getpid(), "rss": _rss(), "load_s": time.monotonic() - started}))
    try:
        while True:
            try:
                message = _recv(conn)
            except (EOFError, OSError):
                return 0
            if message[0] == "stop":
                return 0
            _, seq, payload, forward = message
            try:
                result = rank.run(seq, payload, forward)
                _send(conn, ("ok", result, {"rss": _rss(), "device_bytes": rank.pipe.device_bytes()}))
            except Cancelled:
                _send(conn, ("cancelled",))
            except BaseException as e:  # one line to the parent; no traceback spam
                _send(conn, _error_line(e))
    finally:
        rank.close()


def main(conn_fd: int, lifeline_fd: int) -> None:
    """The worker process: :func:`serve`, then exit without the interpreter's teardown (the pipeline and the
    process group are already freed; unloading torch's modules would only add seconds to every stop)."""
    code = 1
    try:
        code = serve(conn_fd, lifeline_fd)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
