"""configs/SETTINGS.md (engine/api/settings_table.py): current with the config classes and TRL's name maps, and no
accepted field is read by nothing."""

import dataclasses

from engine.api.settings_table import REGENERATE, TABLE_PATH, field_docstrings, first_sentence, render, setting_rows
from engine.config import EngineConfig


def test_settings_table_is_current():
    assert TABLE_PATH.read_text() == render(), f"{TABLE_PATH} is stale: run `{REGENERATE}` and commit it"


def test_every_config_field_is_read_by_some_module():
    unread = [row.path for row in setting_rows() if not row.readers]
    assert not unread, f"accepted but read by nothing (make them act, or refuse them in engine/validation.py): {unread}"


def test_every_config_field_has_a_docstring_that_says_what_it_is():
    docs = field_docstrings()
    undocumented = []
    for section in dataclasses.fields(EngineConfig):
        cls = section.default_factory  # type: ignore[misc]
        for leaf in dataclasses.fields(cls):
            meaning = first_sentence(docs.get((cls.__name__, leaf.name), ""))
            if len(meaning.split()) < 4:  # what SETTINGS.md shows: "Adam beta1." or "Nats." says nothing
                undocumented.append(f"{section.name}.{leaf.name}: {meaning!r}")
    assert not undocumented, ("config fields need a docstring in engine/config.py, one line: meaning, unit, special "
                              f"values, TRL's name where it differs: {undocumented}")


def test_every_trl_argument_has_a_row():
    import pytest

    trl = pytest.importorskip("trl")
    table = render()
    leaves = {row.path.split(".")[-1] for row in setting_rows()}
    missing = [f.name for f in dataclasses.fields(trl.GRPOConfig)
               if f.name not in leaves and f"| `{f.name}` |" not in table]
    assert not missing, f"TRL arguments without a row in {TABLE_PATH}: {missing}"


def test_first_sentence_keeps_abbreviations():
    assert first_sentence("One line, e.g. this.\n  Next.") == "One line, e.g. this."
