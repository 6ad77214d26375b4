"""configs/SETTINGS.md, generated: every setting the engine accepts and what becomes of it.

Owns: the table of every config field (engine/config.py's dataclasses, by dotted path: its default, the first sentence
of its docstring, and the modules that read it) and of every other keyword TRL's `GRPOConfig` accepts here
(engine/api/trl_config.py: `TRANSLATED` names and what they become, `TRAINER_ARGUMENTS` (GRPOTrainer's evaluation
schedule), `NO_EFFECT` names with the reason the one
warning gives, `REFUSED` names with the reason of their error). Nothing is described by hand here: the field
docstrings and the three maps are the sources, so fields other modules add or remove appear after a regeneration.

"Read by" is found in code only (comments and docstrings left
out): a module of engine/ or kernels/ (outside config.py, validation.py, the TRL argument mapping trl_config.py /
trl_fields.py / trl_script.py / trl_async.py, and this module) that uses the
field as an attribute (`.name`), a key (`"name"`) or a keyword (`name=`). A heuristic: a name used for another purpose (`dtype`) hides a miss; an empty cell
is a field nothing reads, which tests/unit/test_settings_table.py refuses.

Must not: import torch, Megatron, vLLM or trl (it runs wherever the config loads).

Run: `python -m engine.api.settings_table` (rewrites configs/SETTINGS.md; `--check` exits 1 when it is stale).
Test: `pytest tests/unit/test_settings_table.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

from engine.api.trl_config import CALLABLE_FIELDS, NO_EFFECT, REFUSED, TRAINER_ARGUMENTS, TRANSLATED
from engine.config import EngineConfig
from engine.config_docstrings import field_docstrings

REPO = Path(__file__).resolve().parents[2]
TABLE_PATH = REPO / "configs" / "SETTINGS.md"
REGENERATE = "python -m engine.api.settings_table"
NOT_READERS = {"config.py", "validation.py", "trl_config.py", "trl_fields.py", "trl_script.py", "trl_async.py",
               "settings_table.py"}
"""Modules that define, check or translate fields: mentioning a field there is not acting on it."""
_MAX_READERS = 3


@dataclasses.dataclass(frozen=True)
class SettingRow:
    path: str
    """Dotted path, e.g. `grpo.beta` (the leaf is also its flat GRPOConfig keyword)."""
    default: str
    meaning: str
    readers: tuple[str, ...]
    """Modules (repository paths) that read the field; empty = nothing does."""


def first_sentence(text: str) -> str:
    """The docstring's first sentence on one line (abbreviations such as `e.g.` do not end it)."""
    flat = " ".join(text.split())
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(\s|$)", flat)
    return flat[: match.start() + 1] if match else flat


def reader_names(source: str) -> frozenset[str]:
    """The names a module's code uses as an attribute (`.name`), a key (`"name"`) or a keyword / assignment target
    (`name=`, not `name==`): comments and other string literals (docstrings that name a setting) left out."""
    names, previous = set(), None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if token.type == tokenize.STRING and re.fullmatch(r"[\"'][A-Za-z_]\w*[\"']", token.string):
            names.add(token.string[1:-1])
        elif token.type == tokenize.NAME and previous is not None and previous.string == ".":
            names.add(token.string)
        elif token.string == "=" and previous is not None and previous.type == tokenize.NAME:
            names.add(previous.string)
        if token.type != tokenize.STRING or re.fullmatch(r"[\"'][A-Za-z_]\w*[\"']", token.string):
            previous = token
    return frozenset(names)


@functools.lru_cache(maxsize=4)
def _module_names(repo: Path, stamp: tuple) -> dict[str, frozenset[str]]:
    return {str(path.relative_to(repo)): reader_names(path.read_text(errors="ignore")) for path, _ in stamp}


def _sources(repo: Path) -> dict[str, frozenset[str]]:
    """Each engine/ and kernels/ module's `reader_names`, computed once per process while no file changes."""
    paths = [path for folder in ("engine", "kernels") for path in sorted((repo / folder).rglob("*.py"))
             if path.name not in NOT_READERS]
    return _module_names(repo, tuple((path, path.stat().st_mtime_ns) for path in paths))


def readers_of(name: str, sources: dict[str, frozenset[str]]) -> tuple[str, ...]:
    """The modules whose code uses `name` as an attribute, a key or a keyword (`reader_names`)."""
    return tuple(module for module, names in sources.items() if name in names)


def _shown_default(value) -> str:
    return "`None`" if value is None else f"`{value!r}`"


def setting_rows(repo: Path = REPO) -> list[SettingRow]:
    """One row per config field, in the tree's order."""
    docs, sources, rows = field_docstrings(repo / "engine" / "config.py"), _sources(repo), []
    for section in dataclasses.fields(EngineConfig):
        instance = section.default_factory()  # type: ignore[misc]
        for leaf in dataclasses.fields(instance):
            doc = docs.get((type(instance).__name__, leaf.name), "")
            meaning = first_sentence(doc) if doc else "(no docstring in engine/config.py)"
            if leaf.name in CALLABLE_FIELDS:
                meaning += " A callable object is accepted too (GRPOConfig / train keyword)."
            rows.append(SettingRow(f"{section.name}.{leaf.name}", _shown_default(getattr(instance, leaf.name)),
                                   meaning, readers_of(leaf.name, sources)))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _readers_cell(readers: tuple[str, ...]) -> str:
    if not readers:
        return "**nothing**"
    shown = ", ".join(f"`{r}`" for r in readers[:_MAX_READERS])
    return shown + (f" (+{len(readers) - _MAX_READERS})" if len(readers) > _MAX_READERS else "")


def render(repo: Path = REPO) -> str:
    """The whole of configs/SETTINGS.md."""
    lines = [
        "# Every setting, and what it does here",
        "",
        f"Generated by `{REGENERATE}` from engine/config.py (each field's default and the first sentence of its",
        "docstring) and engine/api/trl_config.py (TRL's other names); do not edit by hand.",
        "tests/unit/test_settings_table.py fails when this file is stale or when a field is read by nothing.",
        "Every field is a YAML key (`section.field`) and a dotted override, and its leaf name is a `GRPOConfig`",
        "keyword (TRL's name where TRL has the setting).",
        "",
        "## Config fields",
        "",
        "| setting | default | what it does here | read by |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{row.path}` | {_cell(row.default)} | {_cell(row.meaning)} | {_readers_cell(row.readers)} |"
              for row in setting_rows(repo)]
    lines += ["", "## TRL names translated onto the fields above", "", "| TRL argument | becomes |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(target)} |" for name, target in TRANSLATED.items()]
    lines += ["", "## TRL names GRPOTrainer acts on itself (the evaluation schedule)", "",
              "| TRL argument | default | what it does |", "|---|---|---|"]
    lines += [f"| `{name}` | {_cell(repr(default))} | {_cell(meaning)} |"
              for name, (default, meaning) in TRAINER_ARGUMENTS.items()]
    lines += ["", "## TRL names with no effect here (accepted; named in one UserWarning with the reason)", "",
              "| TRL argument | why it has no effect |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(reason)} |" for name, reason in sorted(NO_EFFECT.items())]
    lines += ["", "## TRL names refused (accepted only at TRL's default; any other value raises NotImplementedError)",
              "", "| TRL argument | why |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(reason)} |" for name, reason in sorted(REFUSED.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if configs/SETTINGS.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TABLE_PATH.read_text() if TABLE_PATH.exists() else ""
        if current != text:
            print(f"{TABLE_PATH} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    TABLE_PATH.write_text(text)
    print(f"wrote {TABLE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
