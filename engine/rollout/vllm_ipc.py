"""vLLM's ZMQ IPC sockets: every engine this project starts gets a folder of its own for them, removed when it closes.

Owns: `IpcFolder` (made before an engine starts, set as VLLM_RPC_BASE_PATH; `release` removes it and restores the
variable), `sweep_killed` (the folders of killed processes) and `PREFIX`, the start of their names.

Why: vLLM names its IPC endpoints `<VLLM_RPC_BASE_PATH>/<uuid4>` (NOTE: vllm 0.32 `get_open_zmq_ipc_path`, the base
defaulting to the machine's temporary directory) and never removes what a stopped or killed process left: every test,
every server restart left unix sockets in /tmp. A folder per engine, removed at close (at interpreter exit as a
backstop), leaves nothing; a killed process's folder is removed by the next engine started on the machine (its
name carries the machine and the process). A base the user set in VLLM_RPC_BASE_PATH is respected: the folder is made inside it (a
base too long for the sockets' paths is refused, naming the variable). vLLM's engine-core and worker processes
inherit the variable when they start; `VLLMEngine.close` removes the folder after they are shut down. vLLM caches its
environment once an engine starts (`vllm.envs.enable_envs_cache`, in-process for colocated engines): the cache is
dropped here, so the next engine in the process reads its own folder.

Must not: import vLLM (engine/rollout/vllm_engine.py does; its `envs` module is used only if already imported), remove
anything but folders named as its own, and of those only the ones whose process is gone.

Test: tests/unit/test_vllm_ipc.py (made, set, removed; a user's base; a failed start; exit; killed);
tests/integration/test_weight_sync.py (a colocated engine's paths lie in its folder, gone at close or a failed start);
tests/integration/test_rollout_server.py (a server's nodes leave nothing in their base).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
import tempfile
import weakref

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "grpo-vllm-ipc-"
"""Start of the name of an engine's IPC folder."""

MAX_SOCKET_PATH = 107
"""Bytes a unix socket's path may have (Linux `sun_path`, 108 with its terminating NUL)."""
SOCKET_NAME = 36
"""vLLM's socket names: a uuid4."""

HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]
"""This machine in a folder's name (`<PREFIX><HOST>-<pid>-<random>`): only its own processes' folders are swept."""

_made: dict[str, str | None] = {}
"""Folders made and not yet released -> the VLLM_RPC_BASE_PATH the user had set (None: unset)."""


def _uncache_vllm_envs() -> None:
    """Drop vLLM's environment cache (if vLLM is imported and cached it), so VLLM_RPC_BASE_PATH is read afresh.
    NOTE: vllm 0.32 caches every variable once an engine core or worker has started (`enable_envs_cache`)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None and getattr(envs, "_is_envs_cache_enabled", lambda: False)():
        envs.disable_envs_cache()


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_killed(base: str | None = None) -> list[str]:
    """Remove the IPC folders in `base` (None: the temporary directory) of this machine's processes that are gone
    without closing their engine (killed: no close, no exit hook ran); the paths removed."""
    base = base or tempfile.gettempdir()
    own = re.compile(rf"{re.escape(PREFIX)}{HOST}-(\d+)-")
    removed = []
    for entry in os.scandir(base):
        match = own.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _is_running(int(match.group(1))):
            _remove(entry.path)
            removed.append(entry.path)
    return removed


class IpcFolder:
    """A private folder for one engine's IPC sockets, set as VLLM_RPC_BASE_PATH until `release` (idempotent)."""

    def __init__(self):
        held = os.environ.get(ENV)
        self.user_base = _made.get(held, held) if held else None
        """The base the user set (None: the temporary directory); another engine's folder is never a base."""
        sweep_killed(self.user_base)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{HOST}-{os.getpid()}-", dir=self.user_base)
        if len(os.fsencode(self.path)) + 1 + SOCKET_NAME > MAX_SOCKET_PATH:
            _remove(self.path)
            raise ValueError(f"vLLM's IPC sockets in {self.path}/ would have paths of "
                             f"{len(os.fsencode(self.path)) + 1 + SOCKET_NAME} bytes, over the {MAX_SOCKET_PATH} a "
                             f"unix socket may have: set {ENV} (or TMPDIR) to a shorter folder")
        self._held = held
        _made[self.path] = self.user_base
        os.environ[ENV] = self.path
        _uncache_vllm_envs()
        self._finalizer = weakref.finalize(self, _remove, self.path)  # runs at interpreter exit if not released

    def release(self) -> None:
        """Remove the folder and what vLLM left in it; VLLM_RPC_BASE_PATH back to what it was (an engine's folder
        still open) or to the user's (unset if none)."""
        _made.pop(self.path, None)
        if os.environ.get(ENV) == self.path:
            back = self._held if self._held in _made else self.user_base
            if back is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = back
            _uncache_vllm_envs()
        self._finalizer()
