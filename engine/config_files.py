"""The config tree as files and plain data: dotted command-line overrides, the plain-data form, the resolved config
written into the run directory, and how a user hook given as an object is recorded.

Owns: `ConfigError`, `apply_overrides`, `config_to_dict`, `describe_callable`, `write_resolved_config`
(engine/config.py re-exports them: the tree's public API stays `engine.config`; they live here to keep that module
under 600 lines).

Must not: import engine/config.py (it imports this module), read the environment.

Test: `pytest tests/unit/test_config.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that cannot run: the message names the dotted path and what to change."""


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted `section.key=value` overrides (a leading `--` is allowed); values are parsed as YAML."""
    data = _deep_copy(data)
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. grpo.beta=0.04")
        dotted, raw = text.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                section = ".".join(keys[: depth + 1])
                raise ConfigError(f"override {item!r}: '{section}' is a value, not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def _deep_copy(data: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def config_to_dict(cfg: Any) -> dict:
    """The tree as plain data (what `build_config` accepts back)."""
    return dataclasses.asdict(cfg)


def describe_callable(func: Any) -> str:
    """How a user hook passed as an object is recorded in the tree (which holds strings, so the resolved config and
    checkpoints stay plain data): `module:qualname` for a function (importable back when it is module-level in an
    importable module; `__main__:f`, `m:<lambda>`, `m:f.<locals>.g` are descriptions only), `module:Class()` for an
    instance of `Class`. The object itself travels in memory to `engine.train.loop.train`."""
    if isinstance(func, functools.partial):
        return f"functools.partial({describe_callable(func.func)})"
    qualname = getattr(func, "__qualname__", None)
    if isinstance(qualname, str):
        return f"{getattr(func, '__module__', None) or type(func).__module__}:{qualname}"
    return f"{type(func).__module__}:{type(func).__qualname__}()"


def write_resolved_config(cfg: Any, run_dir: str | Path) -> Path:
    """Write the fully resolved config to `<run_dir>/config.yaml` (atomically) and return its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text("# resolved config: every field, defaults included\n" + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    tmp.replace(target)
    return target

