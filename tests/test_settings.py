"""The settings registry: every SAMEBITS_* variable declared once, documented, parsed one way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from samebits import settings
from samebits.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_docs_page_is_generated_from_the_registry():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page.strip() == settings.render_markdown().strip(), (
        "docs/settings.md is stale: run `python -m samebits.settings > docs/settings.md`")


def test_every_variable_the_code_names_is_declared():
    used = set()
    for path in (ROOT / "src" / "samebits").rglob("*.py"):
        used |= set(re.findall(r"SAMEBITS_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    undeclared = sorted(used - set(settings.REGISTRY))
    assert not undeclared, f"SAMEBITS_* variables read but not declared in samebits/settings.py: {undeclared}"


def test_read_parses_and_names_the_variable_on_bad_values():
    env = {"SAMEBITS_STEPS": "3:9", "SAMEBITS_RANKS": "0,2-3", "SAMEBITS_DISABLE": "YES",
           "SAMEBITS_FLUSH_STEPS": "4", "SAMEBITS_PHASES": "grads, params"}
    assert settings.read("SAMEBITS_STEPS", env) == (3, 9)
    assert settings.read("SAMEBITS_RANKS", env) == frozenset({0, 2, 3})
    assert settings.read("SAMEBITS_DISABLE", env) is True
    assert settings.read("SAMEBITS_FLUSH_STEPS", env) == 4
    assert settings.read("SAMEBITS_PHASES", env) == ("grads", "params")
    assert settings.read("SAMEBITS_FLUSH_STEPS", {}) == 1  # the default
    for name, value, words in (("SAMEBITS_DISABLE", "maybe", "yes/no"), ("SAMEBITS_FLUSH_STEPS", "x", "integer"),
                               ("SAMEBITS_STEPS", "9:3", "empty"), ("SAMEBITS_RANKS", "a", "rank list")):
        with pytest.raises(ConfigError, match=f"{name}=.*{words}"):
            settings.read(name, {name: value})
    with pytest.raises(ConfigError, match="not a samebits setting"):
        settings.read("SAMEBITS_NOPE", {})


def test_a_launcher_rank_that_is_not_a_number_is_refused(tmp_path, monkeypatch):
    """RANK=abc was taken for rank 0: a second process would write rank 0's stream again."""
    import samebits
    from samebits.errors import ConfigError

    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(ConfigError, match=r"RANK='abc' in the environment is not a whole number"):
        samebits.Recorder(tmp_path / "run")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert samebits.Recorder(tmp_path / "run").rank == 3
