"""`grpo-engine plan` and `grpo-engine train --dry-run` import no torch: the planner, the weight-sync plan it sizes and
the converter's name map (engine/policy/hf_map.py) are arithmetic, so a login node (and every node of a SLURM dry
run) plans in about a second."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "vllm", "transformers")

PROBE = """
import sys
from engine.cli import main
codes = [main(argv) for argv in {argvs!r}]
print(codes, sorted(name for name in {heavy!r} if name in sys.modules))
"""


@pytest.mark.parametrize("config", ["qwen3-30b-a3b_tp2_ep8_split_2x1.yaml", "gpt-oss-120b_tp2_ep64_split_8x1.yaml",
                                    "qwen2.5-7b_tp2_dp4_1node.yaml"])
def test_plan_and_dry_run_import_no_torch(config):
    path = str(REPO / "configs" / config)
    argvs = [["plan", path], ["train", path, "--dry-run"]]
    probe = PROBE.format(argvs=argvs, heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    codes, imported = done.stdout.strip().splitlines()[-1].split("] ")
    assert codes == "[0, 0", done.stdout[-2000:]  # both plans fit: the sync plan was sized, not skipped
    assert imported == "[]", f"the planning path imported {imported}"
