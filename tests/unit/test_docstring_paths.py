"""Every `tests/...` path a docstring names exists (issue 26): the "how to test" line of a module is where a reader
starts, so a renamed or deleted test file must not leave it pointing nowhere.

Read: the docstrings (module, class, function) of engine/, kernels/ and benchmarks/, and the comments of launch/'s
scripts (their docstrings); a `tests/<...>` path followed by `::name` must also define that test function or class.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/:])tests/[\w/.-]*\w(?:::\w+)?")


def _docstrings(path: Path) -> list[str]:
    if path.suffix != ".py":
        return [line for line in path.read_text().splitlines() if line.lstrip().startswith("#")]
    tree = ast.parse(path.read_text())
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [doc for doc in (ast.get_docstring(n) for n in nodes) if doc]


def _named_paths() -> dict[str, set[str]]:
    """tests/... path (with its ::name, if any) -> the files whose docstrings name it."""
    named: dict[str, set[str]] = {}
    for folder in ("engine", "kernels", "benchmarks", "launch"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".sh", ".slurm"):
                continue
            for doc in _docstrings(path):
                for found in PATH.findall(re.sub(r"/\n\s*", "/", doc)):  # a path wrapped after a slash
                    named.setdefault(found.rstrip("."), set()).add(str(path.relative_to(ROOT)))
    return named


def _exists(named: str) -> bool:
    path, _, name = named.partition("::")
    target = ROOT / path
    if not name:
        return target.exists()
    return target.is_file() and re.search(rf"^\s*(def|class) {re.escape(name)}\b", target.read_text(), re.M) is not None


def test_every_tests_path_named_in_a_docstring_exists():
    named = _named_paths()
    assert len(named) > 50, f"the docstrings name few test paths ({len(named)}): is the pattern still right?"
    missing = {path: sorted(where) for path, where in named.items() if not _exists(path)}
    assert not missing, f"docstrings name test paths that do not exist: {missing}"
