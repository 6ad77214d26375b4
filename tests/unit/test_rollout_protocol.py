"""The loop's one seam to generation: both engines implement `RolloutEngine` (engine/rollout/protocol.py)
with its signatures, and the loop's modules use nothing else of an engine and never ask for the mode.

Read from the source and the classes (no engine is started): the behaviour is tested with real engines in
tests/integration/test_weight_sync.py (colocated turns), test_rollout_server.py (server turns, restarts),
test_trainer.py and test_async_rollout.py (the loop in both modes).
"""

import ast
import inspect
from pathlib import Path

import pytest

from engine.rollout.client import PendingGenerate
from engine.rollout.colocated import ColocatedRollout, GeneratedRollout
from engine.rollout.protocol import PendingRollout, RolloutEngine
from engine.rollout.server_rollout import ServerRollout

ENGINE = Path(__file__).resolve().parents[2] / "engine"
LOOP_MODULES = ("train/loop.py", "train/sampling.py", "train/rollout_pipeline.py", "train/run.py")


def _members(protocol) -> tuple[set[str], set[str]]:
    """(methods, data attributes) a protocol declares."""
    methods = {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    return methods, set(protocol.__annotations__)


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("protocol,implementation", [
    (RolloutEngine, ColocatedRollout), (RolloutEngine, ServerRollout),
    (PendingRollout, GeneratedRollout), (PendingRollout, PendingGenerate),
])
def test_each_engine_implements_every_protocol_method_with_its_parameters(protocol, implementation):
    methods, attributes = _members(protocol)
    assert methods, protocol
    for name in sorted(methods):
        assert callable(getattr(implementation, name, None)), f"{implementation.__name__} lacks {name}()"
        theirs, ours = _parameters(getattr(implementation, name)), _parameters(getattr(protocol, name))
        assert theirs == ours, f"{implementation.__name__}.{name}{theirs}: the protocol says {ours}"
    source = inspect.getsource(implementation)
    for name in attributes:  # set on the class or in __init__
        assert hasattr(implementation, name) or f"self.{name}" in source, f"{implementation.__name__} lacks {name}"


def _engine_uses(tree: ast.AST) -> set[str]:
    """Attributes read off anything called `engine` (`run.engine.x`, `self.engine.x`, `engine.x`)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "engine":
                used.add(node.attr)
    return used


def test_the_loop_calls_only_the_protocol_and_chooses_the_mode_once():
    methods, attributes = _members(RolloutEngine)
    mode_checks = {}
    for relative in LOOP_MODULES:
        source = (ENGINE / relative).read_text()
        tree = ast.parse(source)
        extra = _engine_uses(tree) - methods - attributes
        assert not extra, f"engine/{relative} uses {sorted(extra)} of the engine: not in RolloutEngine"
        mode_checks[relative] = sum(isinstance(n, ast.Attribute) and n.attr == "vllm_mode" for n in ast.walk(tree))
    assert mode_checks == {"train/loop.py": 0, "train/sampling.py": 0, "train/rollout_pipeline.py": 0,
                           "train/run.py": 1}, f"rollout.vllm_mode is read once, in run.py build_engine: {mode_checks}"
