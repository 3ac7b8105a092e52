"""Worker processes of ``VideoGenerator.from_pretrained(..., num_gpus=N)`` outside a launcher.

:class:`ParallelGenerator` starts N processes (spawned, so CUDA starts fresh in each), one pipe each. Every worker
initialises a gloo/NCCL process group through a file store, loads the model as one rank
(:func:`fastwan.parallel.launch.join`) and then runs each request it receives: every rank runs it, rank 0 sends the
result back (it alone decodes and writes the video), the others send None.

Errors: a worker sends its exception with its rank; the first failure to arrive is the one reported (the ranks
that fail after it mostly fail because of it). When every rank answered and each failure is a user error (an
argument rule checked on every rank alike before any compute, or rank 0's video file that cannot be written after
the others finished), that error is raised as itself and the workers stay: no rank waits in a collective. Any other
failure (a rank raising anything else, a rank silent after the others' error, a process dying) ends every worker
-- the ranks still waiting in a collective cannot finish -- and raises :class:`ParallelError` naming the rank, so
no call hangs on a failed rank. A call left before every rank answered (Ctrl-C) ends every worker too: a late
answer must never be taken as the next request's. Workers ignore Ctrl-C (SIGINT), which a terminal sends to every
process of the group: the parent takes it and ends them (SIGTERM: a worker clears its progress bars and exits), and
they print nothing else (no traceback, no leaked semaphore, no third-party progress bars: :mod:`fastwan.quiet`).
Loading failures end the workers (they exit after reporting).

Rule (Python's, for the spawn start method): each worker first re-imports the main module, so a script starts
workers only under ``if __name__ == "__main__":``. A process still re-importing its main module that is asked for
workers (:func:`refuse_while_importing_main`) exits with :data:`MAIN_REIMPORT_EXIT`, which the parent reports as a
:class:`MainGuardError` naming the fix.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection as mpc
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from fastwan import envs
from fastwan.errors import UserError
from fastwan.quiet import quiet_libraries

GRACE_S = 5.0  # after one rank's error, how long the others get to report theirs before all are ended
STOP_GRACE_S = 5.0  # how long workers sent SIGTERM get to exit before they are killed
MAIN_REIMPORT_EXIT = 78  # a spawned process's exit code: its main module asked for workers while being re-imported
ABORT = "abort"  # the parent to rank 0, its verdict on a step report: stop the running call at this step
GO = "go"  # the parent to rank 0, its verdict on a step report: go on
REPORT_STEPS = "_report_steps"  # a call's keyword: give the ranks a step callback that reports to the parent


class ParallelError(RuntimeError):
    """A worker process failed; the message names its rank."""


class MainGuardError(ParallelError, UserError):
    """The workers died re-importing the caller's main module, which starts workers at import time: the call
    belongs under ``if __name__ == "__main__":``."""


def main_module() -> str:
    """The main module's file (``__main__.__file__``), or a description when it has none."""
    return getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"


def refuse_while_importing_main(num_gpus: int) -> None:
    """In a spawned process still re-importing its parent's main module (the spawn start method re-runs the script
    before the process's own work), starting workers would start them again in every worker and fail: say so on one
    line and exit with :data:`MAIN_REIMPORT_EXIT`; the parent's :class:`ParallelGenerator` raises
    :class:`MainGuardError`. Elsewhere nothing happens."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # set by spawn while it re-imports main
        print(f"fastwan: error: from_pretrained(num_gpus={num_gpus}) runs while this spawned process re-imports "
              "its main module; put that call under 'if __name__ == \"__main__\":' (Python's multiprocessing "
              "rule); this process exits.", file=sys.stderr)
        raise SystemExit(MAIN_REIMPORT_EXIT)


def _stop(signum, frame) -> None:
    """A worker's SIGTERM handler (how the parent ends its workers at once): clear this worker's progress bars, as
    the line they were drawn on is the parent's next, and exit with SIGTERM's exit code."""
    for bar in list(tqdm._instances):
        bar.leave = False
        bar.close()
    os._exit(128 + signum)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored meanwhile: the processes started inside ignore Ctrl-C from their first instruction (an ignored
    signal stays ignored across exec), which the parent takes and ends them for. Only the main thread may change a
    handler; elsewhere, or when the handler was not set from Python, nothing changes (each worker ignores SIGINT
    itself once it runs)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker(rank: int, world: int, store: str, loader, model, kwargs: dict, device: str, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends the workers (close)
    signal.signal(signal.SIGTERM, _stop)
    # tqdm's default lock is a multiprocessing semaphore, which a worker that does not exit normally leaves
    # registered (a "leaked semaphore" warning at exit); a worker's bars need a lock of this process only
    tqdm.set_lock(threading.RLock())
    quiet_libraries()  # N ranks' loading bars would interleave
    envs.disable_multicast()
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if device.startswith("cuda"):
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"file://{store}",
                                rank=rank, world_size=world)
        gen = loader(model, **{**kwargs, "device": device})
        conn.send(("ok", {"checkpoint": gen.checkpoint, "preset": gen.preset, "memory_plan": gen.memory_plan,
                              "device": getattr(gen, "device", device)} if rank == 0 else None))
    except BaseException as exc:  # noqa: BLE001 -- every failure goes to the parent, with this rank
        conn.send(("error", rank, _portable(exc), traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg in (ABORT, GO):  # a verdict is read by the step that asked for it; none is left between calls
            continue
        name, args, kw = msg
        try:
            if kw.pop(REPORT_STEPS, False):
                kw["on_step"] = _step_reporter(rank, conn, getattr(gen, "device", device))
            out = getattr(gen, name)(*args, **kw)
            conn.send(("ok", out if rank == 0 else None))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", rank, _portable(exc), traceback.format_exc()))
    dist.destroy_process_group()


class Aborted(Exception):
    """Raised on every rank at one step when the parent's step callback stopped the call."""


def _step_reporter(rank: int, conn, device):
    """The ranks' ``on_step``: rank 0 sends ``("step", done, total)`` to the parent and waits for its verdict on
    that step (:data:`GO`, or :data:`ABORT` when the parent's own callback raised); rank 0 broadcasts it, so every
    rank raises :class:`Aborted` at the step whose report the callback refused (no rank is left waiting in a
    collective, and no later step runs). The wait overlaps the step's queued device work."""
    where = device if dist.get_backend() == "nccl" else "cpu"

    def on_step(done: int, total: int) -> None:
        stop = torch.zeros(1, dtype=torch.int32, device=where)
        if rank == 0:
            conn.send(("step", done, total))
            if conn.recv() == ABORT:
                stop.fill_(1)
        dist.broadcast(stop, src=0)
        if stop.item():
            raise Aborted(f"stopped at step {done} of {total}")

    return on_step


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles (so the parent can raise the same type), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class ParallelGenerator:
    """N worker processes acting as one :class:`~fastwan.pipelines.generator.VideoGenerator`:
    :meth:`generate_video`, :meth:`load_lora` and :meth:`unload_lora` run on every rank (rank 0's result
    returned); ``checkpoint``, ``preset`` and ``memory_plan`` are rank 0's. :meth:`close` (or ``with``) ends the
    workers. ``parallel`` is None: this process is no rank."""

    parallel = None

    def __init__(self, loader, model, kwargs: dict, num_gpus: int, device: torch.device, target=None):
        """Each worker loads with ``loader(model, **kwargs)`` (``VideoGenerator.from_pretrained``, picklable by
        reference); ``target``: the worker function (default :func:`_worker`; same arguments)."""
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="fastwan-pg-")
        store = os.path.join(self._dir.name, "store")
        self.num_gpus = num_gpus
        self._conns, self._procs = [], []
        with _sigint_ignored():
            for rank in range(num_gpus):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=target or _worker, daemon=True, name=f"fastwan-rank{rank}",
                                args=(rank, num_gpus, store, loader, model, kwargs, str(device), child))
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
        info = self._collect(loading=True)
        self.checkpoint, self.preset, self.memory_plan = info["checkpoint"], info["preset"], info["memory_plan"]
        self.device = info.get("device", device)  # rank 0's

    def _collect(self, loading: bool = False, on_step=None):
        """Every rank's reply -> rank 0's value; a failure raises as the module docstring says. ``loading``: the
        replies to the workers' start (a worker that failed there has exited). ``on_step``: called with rank 0's
        step reports; when it raises, the ranks stop together at their next step and its exception is raised."""
        stopped: list[BaseException] = []
        try:
            replies, waiting = self._replies(on_step, stopped)
        except BaseException:  # left early (Ctrl-C): a rank's late answer would be read as the next request's
            self.close(force=True)
            raise
        if stopped and not waiting and all(v[0] == "ok" or isinstance(v[2], Aborted) for v in replies.values()):
            raise stopped[0]  # every rank stopped at one step (or had finished): the workers stay
        failed = [r for r, v in replies.items() if v[0] != "ok"]  # in arrival order: the first is the cause
        if not failed and not waiting:
            return replies[0][1]
        first = replies[failed[0]]
        exc = first[2]
        if not waiting and all(isinstance(replies[r][2], UserError) for r in failed):
            if loading:  # the failed workers have exited; the others cannot form a job without them
                self.close(force=True)
            raise exc  # every rank answered: none waits in a collective
        world, cause = len(self._conns), failed[0]
        self.close(force=True)
        trace = first[3]  # None for a process that died without a word
        if trace is None and self._exitcodes[cause] == MAIN_REIMPORT_EXIT:
            raise MainGuardError(
                f"num_gpus={world}: the worker processes died re-importing {main_module()}, which calls "
                f"from_pretrained(num_gpus={world}) when imported (the spawn start method re-runs the main script in "
                "every new process, so each worker would start workers of its own); put the call and the code "
                "using it under 'if __name__ == \"__main__\":', as Python's multiprocessing requires.") from None
        what = (f"the process died (exit code {self._exitcodes[cause]})" if trace is None
                else trace.strip().splitlines()[-1])
        raise ParallelError(f"rank {cause} of {world} failed: {what}; every worker was stopped"
                            + ("" if trace is None else f" (rank {cause}'s traceback follows)\n{trace}")) from exc

    def _replies(self, on_step=None, stopped: list | None = None) -> tuple[dict[int, tuple], dict]:
        """Wait for every rank's reply, or, after a first failure, at most ``GRACE_S`` for the others ->
        (the replies by rank, in arrival order; the connections of the ranks that did not answer). Rank 0's step
        reports meanwhile go to ``on_step``; the first exception it raises goes into ``stopped`` and rank 0 is told
        to stop (:data:`ABORT`)."""
        replies: dict[int, tuple] = {}
        waiting = dict(enumerate(self._conns))
        deadline = None
        while waiting:
            sentinels = {self._procs[r].sentinel: r for r in waiting}
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mpc.wait([*waiting.values(), *sentinels], timeout)
            if not ready:
                break  # the grace after an error ran out
            for obj in ready:
                r = sentinels.get(obj)
                if r is not None:
                    if r in waiting and not self._conns[r].poll():
                        replies[r] = ("died", r, None, None)
                        waiting.pop(r)
                    continue
                r = next(k for k, c in waiting.items() if c is obj)
                try:
                    reply = obj.recv()
                except EOFError:
                    reply = ("died", r, None, None)
                if reply[0] == "step":
                    self._step(reply, on_step, stopped)
                    continue
                replies[r] = reply
                waiting.pop(r)
            if deadline is None and any(v[0] != "ok" for v in replies.values()):
                deadline = time.monotonic() + GRACE_S
        return replies, waiting

    def _step(self, report: tuple, on_step, stopped: list) -> None:
        """Rank 0's step report to ``on_step``, answered with the verdict rank 0 waits for: the first exception the
        callback raises is kept and stops the ranks at this step (:data:`ABORT`), else :data:`GO`."""
        if on_step is not None and not stopped:
            try:
                on_step(report[1], report[2])
            except Exception as exc:  # noqa: BLE001 -- the caller's reason to stop, raised once every rank stopped
                stopped.append(exc)
                self._conns[0].send(ABORT)
                return
        self._conns[0].send(ABORT if stopped else GO)

    def _call(self, name: str, args, kwargs, on_step=None):
        if not self._procs:
            raise ParallelError("this parallel generator's worker processes have ended (closed, or stopped after "
                                "a failure); create a new one with VideoGenerator.from_pretrained(num_gpus=...).")
        try:
            for c in self._conns:
                c.send((name, args, {**kwargs, REPORT_STEPS: True} if on_step is not None else kwargs))
        except BaseException:  # some ranks got the request, others not: the job cannot stay in step
            self.close(force=True)
            raise
        return self._collect(on_step=on_step)

    def generate_video(self, prompt: str, **kwargs):
        """:meth:`VideoGenerator.generate_video <fastwan.pipelines.generator.VideoGenerator.generate_video>` on
        every rank; rank 0's result (its frames and file)."""
        return self._call("generate_video", (prompt,), kwargs)

    def generate(self, request, *, on_step=None):
        """:meth:`VideoGenerator.generate <fastwan.pipelines.generator.VideoGenerator.generate>` on every rank
        (a request resolved in this process is sent as its GenerationRequest: each rank resolves it again, against
        the same checkpoint); rank 0's result. ``on_step(done, total)`` is called here after each denoising step
        (rank 0's), which waits for it: when it raises, every rank stops at that step (no later step runs) and the
        exception is raised here, the workers kept."""
        return self._call("generate", (getattr(request, "request", request),), {}, on_step)

    def load_lora(self, path, scale: float = 1.0, expert: int | None = None, *, allow_pickle: bool = False) -> None:
        self._call("load_lora", (path, scale, expert), {"allow_pickle": allow_pickle})

    def unload_lora(self) -> None:
        self._call("unload_lora", (), {})

    def set_progress_bar_config(self, *, disable: bool) -> None:
        """On every rank (:meth:`VideoGenerator.set_progress_bar_config
        <fastwan.pipelines.generator.VideoGenerator.set_progress_bar_config>`)."""
        self._call("set_progress_bar_config", (), {"disable": disable})

    def close(self, force: bool = False) -> None:
        """End the workers: after their current request, or (``force``) at once: SIGTERM (a worker clears its
        progress bars and exits), and a kill for one still running :data:`STOP_GRACE_S` later."""
        procs, self._procs = self._procs, []
        for c, p in zip(self._conns, procs):
            if force:
                p.terminate()
            elif p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (STOP_GRACE_S if force else 30.0)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
            p.join()
        self._exitcodes = [p.exitcode for p in procs]
        for c in self._conns:
            c.close()
        self._conns = []
        self._dir.cleanup()

    def __enter__(self) -> ParallelGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close(force=True)
