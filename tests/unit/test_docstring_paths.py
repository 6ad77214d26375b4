"""Every `tests/...` path a docstring names exists: the "how to test" line of a module is where a reader
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


OUTSIDE = re.compile(r"CPU_STACK|DESIGN\.md|STYLE\.md|anchors/|\.\./shared/")
"""Files that live outside the repository (a reader has only the repository): their content belongs in docs/."""
REFERRING = ("*.py", "*.md", "*.sh", "*.slurm", "*.yaml", "*.toml", "*.cfg", "*.ini", "*.txt", "*.jinja", "Makefile")
PENDING_OUTSIDE: set[str] = set()
"""Files whose one outside reference is left to the model-registry refactor (it moves these files); the test below
also fails once one of them no longer has it, so this set only shrinks."""


def _tracked(*patterns: str) -> list[Path]:
    import subprocess

    names = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / name for name in names if (ROOT / name).is_file()]


def test_nothing_refers_to_files_outside_the_repository():
    hits: dict[str, list[int]] = {}
    for path in _tracked(*REFERRING):
        if path.resolve() == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.setdefault(str(path.relative_to(ROOT)), []).append(number)
    unexpected = {path: lines for path, lines in hits.items() if path not in PENDING_OUTSIDE}
    assert not unexpected, f"references to files outside the repository (their content belongs in docs/): {unexpected}"
    fixed = PENDING_OUTSIDE - set(hits)
    assert not fixed, f"no outside reference left in {sorted(fixed)}: remove them from PENDING_OUTSIDE"


ISSUE = re.compile(r"\bissues? #?\d+", re.I)
UPSTREAM = re.compile(r"(vLLM|vllm|TRL|trl|Megatron|megatron|transformers|torch|NVIDIA|huggingface|PyTorch)[\w-]*'?s?"
                      r"(?: open)? $")
PENDING_ISSUE: set[str] = set()
"""As PENDING_OUTSIDE: left to the model-registry refactor."""


def test_code_docstrings_hold_no_project_issue_numbers():
    """Docstrings and comments (of the code, the tests and the benchmarks) and the docs say what the code is and
    why; the project's issue tracker is history. An upstream issue (`vLLM issue #12330`) is a source and stays."""
    hits: dict[str, list[str]] = {}
    for folder in ("engine", "kernels", "benchmarks", "launch", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".sh", ".slurm", ".md") or "wheels" in path.parts:
                continue
            lines = path.read_text().splitlines()
            texts = lines if path.suffix == ".md" else _docstrings(path) + [line for line in lines if "#" in line]
            for doc in texts:
                for match in ISSUE.finditer(doc):
                    if not UPSTREAM.search(doc[max(0, match.start() - 40):match.start()]):
                        hits.setdefault(str(path.relative_to(ROOT)), []).append(match.group())
    unexpected = {path: found for path, found in hits.items() if path not in PENDING_ISSUE}
    assert not unexpected, f"docstrings or comments cite the project's issue numbers: {unexpected}"
    fixed = PENDING_ISSUE - set(hits)
    assert not fixed, f"no issue number left in {sorted(fixed)}: remove them from PENDING_ISSUE"
