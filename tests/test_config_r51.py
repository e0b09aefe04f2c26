"""Session 51: an unknown key that looks like a valid one names its characters outside ASCII."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftforge.config import load_recipe
from draftforge.recipe_errors import RecipeError

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def test_a_look_alike_letter_in_an_override_key_is_named():
    """'trаin.steps=5' with a Cyrillic 'а' read "trаin: unknown key (did you mean 'train'?)":
    two spellings the eye cannot tell apart."""
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["tr\u0430in.steps=5"])
    assert ("'\u0430' at position 3 is CYRILLIC SMALL LETTER A (U+0430)" in str(info.value)
            and "did you mean 'train'?" in str(info.value))


def test_an_invisible_character_in_a_recipe_key_is_named(tmp_path):
    text = TINY.read_text()
    assert "\n  steps:" in text
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text.replace("\n  steps:", "\n  steps\u200b:", 1))
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    message = str(info.value)
    assert "unknown key" in message and r"'\u200b' at position 6 is ZERO WIDTH SPACE (U+200B)" in message


def test_an_ascii_typo_gets_no_such_note():
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, ["train.stpes=5"])
    assert "did you mean 'steps'?" in str(info.value) and "ASCII" not in str(info.value)


def test_a_random_target_on_sglang_is_refused_with_the_recipe():
    """It passed every check before the job started and was refused by the target rank, after
    torchrun had launched the job."""
    from draftforge.splitserve.roles import recipe_split_problems

    cfg = load_recipe(TINY, ["target.backend=sglang"])
    assert cfg.target.model == "random"
    problems = [cfg.locate(p) for p in recipe_split_problems(cfg)]
    assert any(p.startswith("command line 'target.backend=sglang': target.backend: sglang loads the target's "
                            "weights from a folder") for p in problems), problems
