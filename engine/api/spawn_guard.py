"""The guard that keeps `spawn` children from re-running a flat training script (`GRPOTrainer.train` holds it).

Its own module, with nothing but the standard library, so that a script importing it starts in a fraction of a
second: the guard is about the script's `__main__`, not the trainer.

Must not: import torch, Megatron, vLLM or anything of the engine.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys


@contextlib.contextmanager
def spawn_children_skip_main_script():
    """Let `spawn` children skip the user's script while training runs.

    A child that a library starts with the `spawn` method while training runs (Megatron's asynchronous checkpoint
    writer does, for one; the engine's synchronous saves start none) first re-runs the parent's `__main__` script (as
    `__mp_main__`). TRL scripts are usually flat, without `if __name__ == "__main__":`, so the child would start a
    second training run (and fail on the taken rendezvous port). The children started here run library code only, so `__main__` is
    marked as not re-importable for them: multiprocessing skips a main module whose spec is named `__main__`.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    previous = getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = previous
