"""The engine's own processes end without the interpreter's final walk of every object (engine/cli.py
`freeze_the_heap_at_exit`): by the time the last exit handler runs, what was alive is frozen, and exit handlers
registered before `main` still run."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # registered first: runs last
from engine.cli import main
print("codes:", [main(["check", {config!r}]), main(["check", {config!r}])])
"""


def test_a_command_freezes_the_heap_at_exit_and_earlier_exit_handlers_still_run():
    probe = PROBE.format(config=str(REPO / "configs" / "tiny_cpu.yaml"))
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert "codes: [0, 0]" in lines, done.stdout[-2000:]
    assert lines[-1] == "frozen at exit: True", done.stdout[-2000:]
