"""The attribute docstrings of the config's fields, read from engine/config.py's source (Python does not keep them at
run time). The settings table (engine/api/settings_table.py) and GRPOConfig's parser help (engine/api/trl_config.py)
both show them."""

from __future__ import annotations

import ast
from pathlib import Path

CONFIG_FILE = Path(__file__).resolve().parent / "config.py"


def field_docstrings(config_file: Path = CONFIG_FILE) -> dict[tuple[str, str], str]:
    """{(class name, field name): the string literal right after the field}, from the source (attribute docstrings
    are not kept at runtime)."""
    docs = {}
    for cls in (node for node in ast.parse(config_file.read_text()).body if isinstance(node, ast.ClassDef)):
        for statement, following in zip(cls.body, cls.body[1:] + [None]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
                docs[(cls.name, statement.target.id)] = following.value.value
    return docs
