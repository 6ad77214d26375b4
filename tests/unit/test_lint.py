"""The lint tier: ruff (pyflakes, import order, line length; ruff.toml) finds nothing in the tree.

Fix by hand, or `ruff check --fix .` for what ruff can fix itself (import order, unused imports). Run alone:
`make lint`.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"ruff check found problems (`make lint`):\n{result.stdout[-6000:]}{result.stderr}"
