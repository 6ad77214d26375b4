"""How the engine's own processes end: without the interpreter's final walk of every object.

Owns: `freeze_heap_at_exit`, registered by the entry points of the engine's own processes (`grpo-engine` /
`python -m engine`: engine/cli.py; the rollout server: engine/rollout/server.py).

Why: after a run a process holds about 900k tracked objects (torch, Megatron, vLLM, tokenizers, datasets); the
interpreter's final collections walk them all, module by module: seconds per process (7-8 s on a busy 2-core
machine), paid by every trainer rank and rollout server at its exit. Frozen (`gc.freeze`), objects are still released
by reference counting, and every exit handler, `weakref.finalize` and static destructor still runs; only objects in
reference cycles still alive at exit are not finalized (the process's end frees their memory).

Must not: be registered on import: a user's own script keeps its interpreter's usual exit.

Test: tests/unit/test_cli_exit.py.
"""

from __future__ import annotations

import atexit
import gc


def _freeze() -> None:
    gc.freeze()


def freeze_heap_at_exit() -> None:
    """At this process's exit, freeze what is alive before the interpreter's final collections (once per process,
    however often it is called). Exit handlers run last-registered first; freezing is order-free, so handlers
    registered before this one (by imports) still run after it as before."""
    atexit.unregister(_freeze)
    atexit.register(_freeze)
