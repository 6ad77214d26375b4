"""Run a test function in N processes joined by a gloo process group; report each rank's failure.

`run_distributed(fn, world_size, *args)` calls `fn(*args)` on `world_size` ranks with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and returns the per-rank return values (pickled, so tensors come
back by value). If any rank raises, or dies, or the whole run exceeds the timeout, it raises AssertionError with every
failing rank's traceback (a rank stuck in a collective behind a failed peer is terminated and reported as such).
`fn` must be importable at module level (it is pickled by name).

Long-lived worlds: starting a rank (a Python that imports torch and Megatron) costs 6-12 s on a 2-core machine, more
than most test bodies, so the processes of a world of each size are kept for the session and run test body after test
body. Ranks are forked by multiprocessing's fork server, which has imported those libraries once
(tests/helpers/warm_python.py `PRELOAD`; the server's environment is the test process's when it started). Each body
still starts from what a fresh rank would see: no process group (the previous body's, and Megatron's groups, are
destroyed after it, and the engine's kept rendezvous store closed; the next one meets on a fresh MASTER_PORT), the
environment, working directory, default dtype, grad mode and thread count restored, its output going where the
test's goes now (pytest's capture of that test). A world is not reused, but shut down and started afresh by the next
call, when a body failed on any rank, timed out, or left something a fresh process would not have: child processes alive, a vLLM engine not dropped, or the
threads of a process group or store that outlived its destruction (something still refers to it; its gloo threads
keep polling, a kept world's idle ranks burned CPU that way). A body that built in-process vLLM engines (colocated
mode) keeps its world too, after vLLM's own clean-up between engines (`cleanup_dist_env_and_memory`: its groups, its
frozen VLLM_* cache); vLLM then stays imported in those ranks (its import-time settings included), which saves the
next such body 10-20 s of rank start and imports. A rank that stops, or cannot take another body, exits without
Python's exit handlers; one that imported vLLM exits through libc's `exit`, whose static destructors unlink the
/dev/shm segments of vLLM's CPU TP groups (colocated engines unlink theirs when they close:
engine/rollout/vllm_release.py). test_launcher.py checks none is left, on a vLLM build with the shared-memory ops
(AVX-512 machines; on an AVX2-only CPU that check has nothing to look at). `close_worlds()` (run at exit) stops the
kept worlds; a rank also exits by itself once the test process is gone.

Must not: hide a failure (every failing rank's traceback is in the error) or let one body's state reach the next
beyond what is listed above (tests/distributed/test_launcher.py checks the list).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import itertools
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours (see close_worlds' atexit)
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import torch.multiprocessing as mp

ERROR_GRACE_S = 20.0  # after a rank fails, how long the others get to report before they count as stuck


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command_of(pid: int) -> str | None:
    """The command line of a live process (None: gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:  # the process ended while we looked
        return None


def _children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the children of `pid` that are not zombies."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:  # the process ended while we looked
            continue
        command = _command_of(int(entry)) if ppid == pid else None
        if command is not None:
            children.append((int(entry), command))
    return children


def _kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _live_children() -> list[str]:
    """The command lines of this process's children that are not zombies (any kind: multiprocessing, subprocess,
    vLLM's, Megatron's checkpoint writers)."""
    return [command for _, command in _children_of(os.getpid())]


def _holds_a_vllm_engine() -> bool:
    """Whether a vLLM `LLM` object outlived its body (a body must close and drop the engines it builds)."""
    gc.collect()
    if "vllm.entrypoints.llm" not in sys.modules:
        return False
    llm_class = sys.modules["vllm.entrypoints.llm"].LLM
    return any(isinstance(obj, llm_class) for obj in gc.get_objects())


def _release_vllm() -> None:
    """vLLM's own clean-up between engines in one process, as its test suite does: its groups and the process group,
    its cache of VLLM_* variables (frozen once an engine starts), the garbage its engine left."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    _vllm_releases.append(os.getpid())


_vllm_releases: list[int] = []
"""This rank's pid once per body after which vLLM's state was released (read by tests/distributed/test_launcher.py)."""


GROUP_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore_uv")
"""Threads of a gloo process group (its device's TCP loop, its work loops) and of a TCP store's server."""


def _group_threads() -> dict[str, int]:
    """This process's threads of process groups and stores still alive ({} when none)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
    return {name: names.count(name) for name in GROUP_THREADS if name in names}


def _why_not_reusable() -> str:
    """Why this rank is no longer as a fresh one would be after a body ("" when it is; module docstring)."""
    children = _live_children()
    if children:
        return f"child processes alive: {children}"
    if _holds_a_vllm_engine():  # (collects garbage first)
        return "a vLLM engine was not dropped"
    threads = _group_threads()  # a destroyed group something still refers to keeps its threads, which poll
    return f"process groups outlived their destruction (threads {threads})" if threads else ""


def _write_where_the_test_writes(test_pid: int) -> None:
    """Point this rank's stdout and stderr (fds 1 and 2) where the test process's point now, as a rank started by
    this test would inherit them: pytest captures each test's output (capfd) by moving the test process's fds, which
    a rank kept from an earlier test would otherwise not follow."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            target = os.open(f"/proc/{test_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # no such fd in the test process: keep this rank's own
            continue
        stream.flush()
        os.dup2(target, fd)
        os.close(target)


def _run_body(body: bytes, test_pid: int) -> tuple[str, bytes | str, str]:
    """Run one pickled (fn, args) on this rank; then tear its groups down and restore the process-wide state it may
    have changed. Returns (status, pickled value or traceback, why this rank cannot take another body: "" if it can)."""
    import torch

    _write_where_the_test_writes(test_pid)
    env, cwd = dict(os.environ), os.getcwd()
    dtype, grad_enabled = torch.get_default_dtype(), torch.is_grad_enabled()
    try:
        fn, args = pickle.loads(body)
        status, payload = "ok", pickle.dumps(fn(*args))
    except BaseException:  # noqa: BLE001 - report everything, including assertion errors and SystemExit
        status, payload = "error", traceback.format_exc()
    torn_down = True
    try:
        from engine.policy.parallel import close_rendezvous, destroy_parallel

        destroy_parallel(keep_process_group=True)  # Megatron's groups, then vLLM's (if imported), then the group
        if "vllm" in sys.modules:
            _release_vllm()
        destroy_parallel()
        close_rendezvous()  # the next body meets on another port
    except Exception:  # noqa: BLE001 - teardown after a failure must not mask the failure
        torn_down = False
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad_enabled)
    torch.set_num_threads(1)
    if status != "ok":
        return status, payload, "the body failed"
    return status, payload, _why_not_reusable() if torn_down else "its teardown failed"


def _exit_with_the_test(test_pid: int) -> None:
    """Exit this rank as soon as the test process is gone, whatever its main thread is doing (even a hung body), and
    take its children along (os._exit runs no exit handler: a child would outlive it)."""
    while _command_of(test_pid) is not None:
        time.sleep(1.0)
    _kill(pid for pid, _ in _children_of(os.getpid()))
    os._exit(0)


def _serve(rank, world_size, tasks, results, test_pid) -> None:
    """A rank of a long-lived world: run each (task id, port, pickled body) it is sent until told to stop."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_the_test, args=(test_pid,), daemon=True).start()
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, port, body = task
        os.environ["MASTER_PORT"] = str(port)
        status, payload, why_not_reusable = _run_body(body, test_pid)
        results.put((rank, task_id, status, payload, why_not_reusable))
        if why_not_reusable:
            break
    _end_rank(results)


def _end_rank(results) -> None:
    """Exit this rank once its reports are flushed. A rank that imported vLLM exits through libc's `exit`, which runs
    the libraries' static destructors: vLLM's CPU shared-memory manager unlinks its /dev/shm segments there (a rank
    ending in os._exit, as a fork server's child does, left them). Any other rank has nothing to shut down: os._exit.
    Python's exit handlers run in neither case (they never ran in a fork server's child)."""
    results.close()
    results.join_thread()
    if "vllm" in sys.modules:
        ctypes.CDLL(None).exit(0)
    os._exit(0)


class _World:
    """The processes of one world size, each with its own task queue, and the queue they all report into."""

    def __init__(self, world_size: int):
        from tests.helpers.warm_python import PRELOAD

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, *PRELOAD])  # acts when this process's fork server starts
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, self.tasks[r], self.results, os.getpid()))
                      for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def run(self, task_id: int, fn, args, timeout_s: float) -> tuple[dict[int, tuple[str, object]], str]:
        """Send one body to every rank; return {rank: (status, payload)} of the ranks that reported, and why the
        world cannot take another body ("" when every rank can)."""
        port, body = _free_port(), pickle.dumps((fn, args))
        for task in self.tasks:
            task.put((task_id, port, body))
        outcome: dict[int, tuple[str, object]] = {}
        why_not: list[str] = []
        deadline = time.monotonic() + timeout_s
        first_error_at = None
        while len(outcome) < self.world_size:
            now = time.monotonic()
            if now > deadline or (first_error_at is not None and now > first_error_at + ERROR_GRACE_S):
                break
            try:
                rank, reported_task, status, payload, rank_why_not = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in outcome]
                for r in dead:
                    outcome[r] = ("error", f"rank {r} died with exit code {self.procs[r].exitcode} before reporting")
                    first_error_at = first_error_at or time.monotonic()
                continue
            if reported_task != task_id:
                continue
            outcome[rank] = (status, payload)
            if rank_why_not:
                why_not.append(f"rank {rank}: {rank_why_not}")
            if status == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        if len(outcome) < self.world_size:
            why_not.append("not every rank reported")
        return outcome, "; ".join(why_not)

    def close(self) -> None:
        """Stop the ranks (a normal exit where they can, else terminated) and whatever processes they started."""
        children = {pid: command for proc in self.procs if proc.is_alive() for pid, command in _children_of(proc.pid)}
        for proc, task in zip(self.procs, self.tasks):
            if proc.is_alive():
                task.put(None)
        for proc in self.procs:
            proc.join(timeout=30)  # a rank that ran vLLM runs the libraries' static destructors (`_end_rank`)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        _kill(pid for pid, command in children.items() if _command_of(pid) == command)  # outlived a terminated rank


_worlds: dict[int, _World] = {}
_task_ids = itertools.count()
world_starts: list[tuple[int, str]] = []
"""(world size, why it started) for every world this process started: its first of that size, or why the last one
was dropped (read by tests/timings.py: a start costs a rank's imports, 6-12 s here, 10-20 s more with vLLM)."""
_dropped: dict[int, str] = {}


def close_worlds() -> None:
    """Stop every kept world (at exit; also usable between tests that must not share a world)."""
    while _worlds:
        size, world = _worlds.popitem()
        world.close()
        _dropped[size] = "closed on request (close_worlds)"


atexit.register(close_worlds)  # NOTE: registered after multiprocessing's own exit handler, so it runs before it


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """Call fn(*args) on `world_size` gloo ranks; return [rank 0's value, rank 1's value, ...]."""
    world = _worlds.pop(world_size, None)
    if world is None:
        world_starts.append((world_size, _dropped.get(world_size, "the first world of this size")))
        world = _World(world_size)
    try:
        outcome, why_not_reusable = world.run(next(_task_ids), fn, args, timeout_s)
    except BaseException:  # e.g. pytest-timeout's alarm or Ctrl-C while the ranks run: they must not outlive it
        world.close()
        _dropped[world_size] = f"{fn.__name__} was interrupted"
        raise
    if not why_not_reusable:
        _worlds[world_size] = world
    else:
        world.close()
        _dropped[world_size] = f"after {fn.__name__}, {why_not_reusable}"
    failures = [f"--- rank {r}: {outcome[r][1]}" for r in sorted(outcome) if outcome[r][0] == "error"]
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        why = "timed out" if not failures else "did not finish after another rank failed"
        failures.append(f"--- ranks {missing} {why} (terminated)")
    if failures:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(failures))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
