"""Megatron's checkpoint writer processes, watched while a save runs (engine/train/checkpoint.py `save_checkpoint`).

Owns: `WriterWatch`, which turns a writer process killed mid-save into an exception in the saving thread.

Must not: know the checkpoint's layout or Megatron's API (it only looks at this process's children), or reap a child
(multiprocessing joins its own).

Test: benchmarks/bench_kill_during_save.py (`writers` points SIGKILL the writers of a real save); without the watch
the trainer waited forever.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from pathlib import Path


class WriterWatch:
    """Fail a save whose Megatron writer process was killed, instead of waiting forever.

    Megatron's torch_dist save forks one writer process per file bucket and waits for them on a JoinableQueue with
    no timeout (megatron/core/dist_checkpointing/strategies/filesystem_async.py): a writer killed by a signal (the
    OOM killer, an operator) never reports, and the run hangs in the save (found by
    benchmarks/bench_kill_during_save.py). While the save runs, a thread looks at the children that appeared since
    it started (`waitid(WNOWAIT)`: seen, not reaped, so multiprocessing still joins them) and, when one died by a
    signal, interrupts the main thread with SIGUSR2, whose handler raises `error` (CheckpointError): the run fails
    with the cause; the checkpoint-<step>.tmp it leaves is ignored by `latest` and replaced by the next save of that
    step.
    Outside the main thread (no signal handler can be installed there) it does nothing. Once it has fired, the
    process exits with status 1 before multiprocessing's exit handler, which could wait forever for a child the
    interrupted save was starting.
    """

    def __init__(self, tmp: Path, error: type[Exception] = RuntimeError, log=print, poll_s: float = 0.05,
                 exit_after_failure: bool = True):
        """Args: tmp: the directory being written (for the message); error: the exception the main thread gets;
        log: called with the message; poll_s: seconds between looks; exit_after_failure: once fired, exit with
        status 1 ahead of multiprocessing's exit handler (tests that go on afterwards pass False)."""
        self.tmp, self.error, self.log, self.poll_s = tmp, error, log, poll_s
        self.exit_after_failure = exit_after_failure
        self.is_active = threading.current_thread() is threading.main_thread()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="checkpoint-writer-watch", daemon=True)
        self._cause: str | None = None

    def __enter__(self) -> WriterWatch:
        if self.is_active:
            self._main = threading.main_thread().ident
            self._before = set(_child_pids())
            self._previous = signal.signal(signal.SIGUSR2, self._interrupt)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.is_active:
            self._stop.set()
            self._thread.join()
            signal.signal(signal.SIGUSR2, self._previous)

    def _interrupt(self, signum, frame) -> None:
        if self._cause is not None:
            # NOTE: the interrupted save may leave multiprocessing's bookkeeping half done (a child being started):
            # its exit handler would then wait for that child forever; the error ends the run, so exit without it
            if self.exit_after_failure:
                atexit.register(_exit_without_joining_children)
            raise self.error(self._cause)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for pid in set(_child_pids()) - self._before:
                try:
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue
                if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    self._cause = (f"Megatron's checkpoint writer process {pid} was killed by signal "
                                   f"{signal.Signals(info.si_status).name} while writing {self.tmp}: the save cannot "
                                   "finish; the earlier checkpoints are intact (resume with "
                                   "checkpoint.resume_from_checkpoint=latest)")
                    self.log(self._cause)
                    if not self._stop.is_set():
                        signal.pthread_kill(self._main, signal.SIGUSR2)
                    return


def _exit_without_joining_children() -> None:
    """Registered last, so run first at exit: end the process (status 1: a save failed) before multiprocessing's
    exit handler joins children an interrupted save left behind."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or broken streams: nothing left to flush
            pass
    os._exit(1)


def _child_pids() -> list[int]:
    """This process's children (those of every thread), from /proc."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids

