"""`python script.py ...` and `python -m module ...` for the slow tiers, forked from an interpreter that has already
imported the heavy libraries, instead of a fresh interpreter importing them again.

Why: a test that runs an example, a guide or `python -m engine ...` as its user does starts a fresh Python, and
importing torch, transformers, Megatron and their dependencies costs about 12 s of a core before the first line of
the script runs (measured on the 2-core dev VM). The slow tiers start some fifty such processes.

How: a warm interpreter (`python -m tests.helpers.warm_python SOCKET`, started at first use, one per test process
and import-time environment) imports `PRELOAD` and then waits on a Unix socket. Each request carries the command
line, the working directory, the environment and the three standard streams (file descriptors); the warm interpreter
forks, and the child sets them up as a fresh interpreter would have them (its own session if asked, `sys.argv`, a new
`__main__`, `sys.path` from PYTHONPATH, the environment, numpy's global seed) and runs the script (or the module, as
`python -m` does). Exceptions, `sys.exit` and the interpreter's shutdown are the child's own, as in a fresh process.
The warm interpreter reports the child's pid, then its exit status (negative: the signal that killed it), as
`subprocess.Popen` does.

What is not warm: vLLM and the engine itself are imported by the child (both read settings from the environment at
import: vLLM its log level, the engine's kernels the Triton interpreter switch). The variables the preloaded
libraries read at import (`IMPORT_TIME_ENV`: HF_HUB_OFFLINE, ...) are the warm interpreter's own: a request that
sets them differently goes to a warm interpreter started with its values. Commands that are not
`[sys.executable, script | -m module, ...]`, or that ask for a pipe, or that a launcher rank (a multiprocessing
child) or a warm child starts, run in a fresh interpreter, as does every
command when GRPO_TESTS_FRESH_PYTHON=1 (the plain `subprocess` path, to compare with).

Use: `Popen` and `run` take the `subprocess` arguments the tests use (args, cwd, env, stdout, stderr,
start_new_session; run: capture_output, text, timeout). Tested by tests/integration/test_warm_python.py.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PRELOAD = ("torch", "numpy", "transformers", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing", "datasets", "peft", "pandas", "safetensors.torch", "yaml",
           "matplotlib.figure", "matplotlib.backends.backend_agg", "openai", "fastapi", "aiohttp", "xgrammar",
           "compressed_tensors")
"""What the warm interpreter imports: the libraries every engine process imports (the last ones: the metrics plot's
and vLLM's dependencies), none of them reading at import an environment variable outside `IMPORT_TIME_ENV`."""

IMPORT_TIME_ENV = re.compile(r"^(HF_|HUGGINGFACE|TRANSFORMERS_|TOKENIZERS_|DATASETS_|TORCH|PYTORCH|TRITON|MKL_|KMP_|"
                             r"OMP_|CUDA|NVTE_|NCCL_|MEGATRON|MPL|PYTHON(?!PATH$|UNBUFFERED$)|LD_|"
                             r"MALLOC|GOMP|NUMEXPR)")
"""Environment variables that act at interpreter start or when a preloaded library is imported (OMP_NUM_THREADS:
OpenMP's default for every thread, read when torch loads it): a request goes to a warm interpreter started with its
values of them. PYTHONPATH (rebuilt into `sys.path`) and PYTHONUNBUFFERED (the streams reconfigured) are applied in
the child."""

FRESH_ENV = "GRPO_TESTS_FRESH_PYTHON"
"""Set to 1: every command runs in a fresh interpreter (plain `subprocess`)."""

_REPO = Path(__file__).resolve().parents[2]


# --- the warm interpreter ---------------------------------------------------------------------------------------------

def _send(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    conn.sendall(len(data).to_bytes(4, "big") + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the warm interpreter closed the connection")
        data += chunk
    return data


def _recv(conn: socket.socket) -> dict:
    return json.loads(_recv_exact(conn, int.from_bytes(_recv_exact(conn, 4), "big")))


def _serve(listener: socket.socket) -> tuple[dict, list[int]]:
    """Accept requests and fork a child for each until the parent goes away; returns only in a child: its request
    and its three stream descriptors."""
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select(timeout=5.0):
            if key.fileobj is wake_r:
                os.read(wake_r, 4096)
                continue
            conn, _ = listener.accept()
            fds = []
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 4, 3)
                request = json.loads(_recv_exact(conn, int.from_bytes(msg, "big")))
            except (OSError, ValueError) as err:  # a client that went away, or not a request: the next one
                print(f"warm interpreter: dropped a request ({err!r})", file=sys.stderr)
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                selector.close()
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                _send(conn, {"pid": pid})
            children[pid] = conn
        while children:  # reap: report each exit to its requester
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        if os.getppid() != parent:  # the test process is gone
            os._exit(0)


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: the process a fresh `python <args>` would be, then run it. Returns when the script or
    module has run; the interpreter's own exit follows (`_serve_main` is the warm interpreter's last statement)."""
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    env = request["env"]
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=unbuffered or stream is sys.stderr, line_buffering=stream.isatty())
    import numpy

    importlib.import_module("tests.helpers.warm_python")._forked_child = True
    numpy.random.seed()  # a fresh interpreter's global numpy state comes from the OS, not from its parent
    pythonpath = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    args = request["args"]
    import types

    main = types.ModuleType("__main__")  # a fresh __main__, as a new interpreter has
    main.__dict__.update(__builtins__=__builtins__, __spec__=None, __package__=None, __cached__=None)
    sys.modules["__main__"] = main
    if args[0] == "-m":
        import runpy

        sys.argv = [args[1], *args[2:]]  # runpy puts the module's path first, as `python -m` does
        sys.path[:] = [os.getcwd(), *pythonpath, *base_path]
        runpy._run_module_as_main(args[1], alter_argv=True)
        return
    script = os.path.abspath(args[0])
    sys.argv = list(args)
    sys.path[:] = [str(Path(script).resolve().parent), *pythonpath, *base_path]
    main.__file__ = script
    exec(compile(Path(script).read_bytes(), script, "exec"), main.__dict__)


def _serve_main(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # ready
    request, fds = _serve(listener)
    _become(request, fds)


# --- the test process's side ------------------------------------------------------------------------------------------

class _Warm:
    """A warm interpreter of the test process, started with `env`, stopped at exit."""

    def __init__(self, env: dict) -> None:
        self.dir = tempfile.mkdtemp(prefix="warm-python-")
        self.path = os.path.join(self.dir, "sock")
        self.log = os.path.join(self.dir, "log")
        self.env = env
        self.running = 0
        """Commands started through it whose exit has not been read yet (one with none running can be stopped)."""
        self.last_used = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.warm_python", self.path], cwd=_REPO,
                                         env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)

    def connect(self) -> socket.socket:
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm interpreter did not start (rc {self.proc.poll()}):\n"
                                   f"{Path(self.log).read_text()[-3000:]}")
            time.sleep(0.05)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        return conn

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


MAX_WARM = 3
"""Warm interpreters a test process keeps at most (one per distinct `IMPORT_TIME_ENV` setting: importing vLLM into
the test process adds some of those variables to its environment, so the requests made after it ask for another).
For a new setting the least recently used one with no command running is stopped; with none such, the command runs
fresh."""

_warms: dict[tuple, _Warm] = {}
_forked_child = False
"""Set in the children of a warm interpreter."""
_lock = threading.Lock()


def _warm_for(env: dict) -> _Warm | None:
    """The warm interpreter whose import-time environment is `env`'s (started now if there is none), or None: run
    fresh (GRPO_TESTS_FRESH_PYTHON=1, or MAX_WARM others already running)."""
    import multiprocessing

    if os.environ.get(FRESH_ENV) == "1" or env.get(FRESH_ENV) == "1":
        return None
    if _forked_child or multiprocessing.parent_process() is not None:
        return None  # a launcher rank or a warm child: a warm interpreter of its own would outlive what it ran
    key = tuple(sorted((k, v) for k, v in env.items() if IMPORT_TIME_ENV.match(k)))
    with _lock:
        warm = _warms.get(key)
        if warm is None or warm.proc.poll() is not None:
            while warm is None and len(_warms) >= MAX_WARM:
                idle = [k for k, w in _warms.items() if w.running == 0]
                if not idle:
                    return None
                _warms.pop(min(idle, key=lambda k: _warms[k].last_used)).stop()
            rest = {k: v for k, v in os.environ.items() if not IMPORT_TIME_ENV.match(k)}
            warm = _warms[key] = _Warm({**rest, **dict(key), "PYTHONPATH": str(_REPO)})
        warm.last_used = time.monotonic()
        warm.running += 1
        return warm


def _python_args(args) -> list[str] | None:
    """The interpreter's arguments of `args` when it is `[sys.executable, script.py | -m module, ...]`, else None."""
    args = [os.fspath(a) for a in args] if not isinstance(args, (str, bytes)) else None
    if not args or len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) > 2 or args[1].endswith(".py") and not args[1].startswith("-"):
        return args[1:]
    return None


def _fd(stream, default: int) -> tuple[int, bool]:
    """(descriptor, whether it was opened here) for a `subprocess` stream argument."""
    if stream is None:
        return default, False
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(stream, int):
        return stream, False
    return stream.fileno(), False


class Popen:
    """`subprocess.Popen` for `python script.py` / `python -m module` commands, forked from the warm interpreter
    where it can be (see the module docstring), else a plain `subprocess.Popen`. pid, poll, wait, send_signal,
    terminate, kill and returncode behave as subprocess's do."""

    def __init__(self, args, cwd=None, env=None, stdin=None, stdout=None, stderr=None, start_new_session=False):
        self.args = args
        self.returncode: int | None = None
        env = dict(os.environ if env is None else env)
        python_args = _python_args(args)
        self._fresh = None
        warm = None if python_args is None or subprocess.PIPE in (stdin, stdout, stderr) else _warm_for(env)
        if warm is None:
            self._fresh = subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                           start_new_session=start_new_session)
            self.pid = self._fresh.pid
            return
        opened = []
        fds = []
        for stream, default in ((stdin, 0), (stdout, 1), (stderr, 2)):
            if stream == subprocess.STDOUT:
                fds.append(fds[1])
                continue
            fd, was_opened = _fd(stream, default)
            fds.append(fd)
            if was_opened:
                opened.append(fd)
        request = {"args": python_args, "cwd": os.path.abspath(cwd or os.getcwd()), "env": env,
                   "new_session": bool(start_new_session)}
        data = json.dumps(request).encode()
        self._warm = warm
        try:
            self._conn = warm.connect()
            socket.send_fds(self._conn, [len(data).to_bytes(4, "big")], fds)
            self._conn.sendall(data)
            self.pid = _recv(self._conn)["pid"]
        except BaseException:
            with _lock:
                warm.running -= 1
            raise
        finally:
            for fd in opened:
                os.close(fd)

    def poll(self) -> int | None:
        if self._fresh is not None:
            self.returncode = self._fresh.poll()
        elif self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._take(self._conn.recv(1, socket.MSG_PEEK))
            except BlockingIOError:
                pass
            finally:
                if self.returncode is None:
                    self._conn.setblocking(True)
        return self.returncode

    def _take(self, peeked: bytes) -> None:
        if not peeked:
            raise ConnectionError(f"the warm interpreter went away before {self.args} ended")
        self._conn.setblocking(True)
        self.returncode = _recv(self._conn)["exit"]
        self._conn.close()
        with _lock:
            self._warm.running -= 1

    def wait(self, timeout: float | None = None) -> int:
        if self._fresh is not None:
            self.returncode = self._fresh.wait(timeout)
        elif self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                peeked = self._conn.recv(1, socket.MSG_PEEK)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._take(peeked)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


def run(args, cwd=None, env=None, capture_output=False, text=False, timeout=None, stdout=None, stderr=None,
        start_new_session=False) -> subprocess.CompletedProcess:
    """`subprocess.run` through `Popen` (captured output goes through temporary files)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if capture_output:
            stdout, stderr = out, err
        proc = Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                     start_new_session=start_new_session)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        captured = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            captured.append(data.decode(errors="replace") if text and data is not None else data)
        return subprocess.CompletedProcess(args, proc.returncode, *captured)


if __name__ == "__main__":
    _serve_main(sys.argv[1])
