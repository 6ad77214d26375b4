"""The engine's own processes (`grpo-engine`, the rollout server) end without the interpreter's final walk of every
object (engine/process_exit.py): by the time the last exit handler runs, what was alive is frozen, and the exit
handlers registered before the entry point still run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")

PROBE = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # registered first: runs last
{call}
"""

CALLS = {
    "grpo-engine": f"from engine.cli import main\nprint('codes:', [main(['check', {CONFIG!r}]), main(['check', {CONFIG!r}])])",
    # without the shared token the server refuses to start (status 2): its entry point still ran
    "rollout server": f"from engine.rollout.server import main\nprint('codes:', [main([{CONFIG!r}])])",
}


@pytest.mark.parametrize("entry", CALLS)
def test_an_entry_point_freezes_the_heap_at_exit_and_earlier_exit_handlers_still_run(entry):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_ENGINE_TOKEN"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(call=CALLS[entry])], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert ("codes: [0, 0]" if entry == "grpo-engine" else "codes: [2]") in lines, done.stdout[-2000:]
    assert lines[-1] == "frozen at exit: True", done.stdout[-2000:]
