"""Run a test function in N processes joined by a gloo process group; report each rank's failure.

`run_distributed(fn, world_size, *args)` spawns `world_size` processes with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), calls `fn(*args)` in each, and returns the per-rank return
values (pickled, so tensors come back by value). If any rank raises, or dies, or the whole run exceeds the timeout,
it raises AssertionError with every failing rank's traceback (a rank stuck in a collective behind a failed peer is
terminated and reported as such). `fn` must be importable at module level (spawn pickles it by name).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything, including assertion errors and SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from engine.policy.parallel import destroy_parallel

        try:
            destroy_parallel()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask the failure
            pass


def run_distributed(fn, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """Call fn(*args) on `world_size` gloo ranks; return [rank 0's value, rank 1's value, ...]."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    first_error_at = None
    while len(outcome) < world_size:
        now = time.monotonic()
        if now > deadline or (first_error_at is not None and now > first_error_at + 20):
            break
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome and p.exitcode]
            for r in dead:
                outcome[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode} before reporting")
                first_error_at = first_error_at or time.monotonic()
            continue
        outcome[rank] = (status, payload)
        if status == "error" and first_error_at is None:
            first_error_at = time.monotonic()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    failures = [f"--- rank {r}: {outcome[r][1]}" for r in sorted(outcome) if outcome[r][0] == "error"]
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        why = "timed out" if first_error_at is None else "did not finish after another rank failed"
        failures.append(f"--- ranks {missing} {why} (terminated)")
    if failures:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(failures))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
