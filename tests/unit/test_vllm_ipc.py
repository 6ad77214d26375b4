"""Every vLLM engine's IPC sockets lie in a folder of its own, removed when it closes (engine/rollout/vllm_ipc.py):

- the folder is made in the temporary directory, set as VLLM_RPC_BASE_PATH, and removed with the sockets in it at
  release, the variable unset again;
- a base the user set is respected: the folder is made inside it, and the user's value is back after release;
- a second engine's folder, made while another is open, lies in the user's base, not in the first engine's folder,
  and the first's is set again when the second closes;
- a failed engine start removes it (as `VLLMEngine` guards its start), and a process that exits without closing its
  engine leaves none behind;
- a killed process's folder (no close, no exit hook) is removed by the next engine started on the machine; a running
  process's, another machine's and anything not named as one are kept.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from engine.rollout.fp8_checkpoint import released_on_error
from engine.rollout.vllm_ipc import ENV, HOST, PREFIX, IpcFolder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def base():
    """A user's VLLM_RPC_BASE_PATH: short, as a unix socket's path must be (pytest's base is too long)."""
    path = Path(tempfile.mkdtemp(prefix="ipc-base-"))
    yield path
    shutil.rmtree(path)


def _bind_socket(folder: str) -> socket.socket:
    """A unix socket bound in `folder`, as vLLM's ZMQ IPC endpoints are (left open: a killed process's)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(folder, "00af9385-2141-420c-865f-ccfd25af5fe2"))
    return sock


def test_folder_is_made_set_and_removed_with_its_sockets(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    folder = IpcFolder()
    path = Path(folder.path)
    assert path.is_dir() and path.parent == Path(tempfile.gettempdir()) and path.name.startswith(PREFIX)
    assert os.environ[ENV] == folder.path
    sock = _bind_socket(folder.path)
    try:
        assert any(p.is_socket() for p in path.iterdir())
        folder.release()
        assert not path.exists(), "the engine's IPC folder outlived its close"
        assert ENV not in os.environ
        folder.release()  # a second close does nothing
    finally:
        sock.close()


def test_a_users_base_is_respected_and_restored(monkeypatch, base):
    monkeypatch.setenv(ENV, str(base))
    first = IpcFolder()
    second = IpcFolder()  # another engine started while the first runs
    assert Path(first.path).parent == base and Path(second.path).parent == base
    assert os.environ[ENV] == second.path
    sock = _bind_socket(second.path)
    try:
        second.release()
        assert os.environ[ENV] == first.path, "the first engine, still open, lost its folder"
        first.release()
    finally:
        sock.close()
    assert list(base.iterdir()) == [], "a folder was left in the user's VLLM_RPC_BASE_PATH"
    assert os.environ[ENV] == str(base)


def test_a_failed_start_removes_the_folder(monkeypatch, base):
    monkeypatch.setenv(ENV, str(base))
    folder = IpcFolder()  # held, as the engine holds it (not removed by garbage collection)
    with pytest.raises(RuntimeError, match="engine failed"):
        with released_on_error(folder):  # as VLLMEngine starts vLLM
            raise RuntimeError("engine failed")
    assert list(base.iterdir()) == [] and os.environ[ENV] == str(base)


def test_a_process_exiting_without_close_leaves_no_folder(base):
    code = ("import os; from engine.rollout.vllm_ipc import IpcFolder; f = IpcFolder(); "
            "open(os.path.join(f.path, 'left'), 'w').close(); print(f.path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **{ENV: str(base)}),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(base / PREFIX)), out
    assert list(base.iterdir()) == [], "a process's exit left its engine's IPC folder"


def test_a_base_too_long_for_socket_paths_is_refused_with_the_cause(monkeypatch, tmp_path):
    long_base = tmp_path / ("b" * 60)
    long_base.mkdir()
    monkeypatch.setenv(ENV, str(long_base))
    with pytest.raises(ValueError, match=f"over the 107 a unix socket may have: set {ENV}"):
        IpcFolder()
    assert list(long_base.iterdir()) == [] and os.environ[ENV] == str(long_base)


def test_a_killed_processs_folder_is_removed_by_the_next_engine(monkeypatch, base):
    monkeypatch.setenv(ENV, str(base))
    code = "import os, time; from engine.rollout.vllm_ipc import IpcFolder; f = IpcFolder(); print(f.path, flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sock = None
    try:
        killed = Path(proc.stdout.readline().strip())
        sock = _bind_socket(str(killed))  # what its engine left
        running = IpcFolder()  # this process's: running
        assert killed.is_dir() and killed.parent == base, "a running process's folder was removed"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if sock is not None:
            sock.close()
    others = [base / f"{PREFIX}ffffff-{proc.pid}-x", base / f"{PREFIX}notapid", base / "unrelated"]
    for path in others:
        path.mkdir()
    nxt = IpcFolder()
    assert not killed.exists(), "a killed process's IPC folder outlived the next engine's start"
    assert all(path.exists() for path in others) and Path(running.path).is_dir(), sorted(base.iterdir())
    nxt.release()
    running.release()
    for path in others:
        path.rmdir()
    assert Path(running.path).name.startswith(f"{PREFIX}{HOST}-{os.getpid()}-")
