"""Usage errors of the ``draftforge`` dispatcher's own commands (core/cli.py)."""

from pathlib import Path

import pytest
import yaml

from draftforge import cli


def test_config_show_without_recipe_names_only_the_recipe(capsys):
    # argparse counted the optional key=value overrides as required too.
    with pytest.raises(SystemExit) as exc:
        cli.main(["config", "show"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: draftforge config show [-h] RECIPE [key=value ...]" in err
    assert err.rstrip().endswith("error: the following arguments are required: RECIPE")
    assert "key=value" not in err.splitlines()[-1]


def test_config_show_without_overrides_prints_the_recipe(capsys):
    # the overrides stay optional (a guard for the default the fix gave them)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    assert cli.main(["config", "show", str(recipe)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["target"]["model"] == "random"


@pytest.mark.parametrize("command", [["train"], ["data", "regenerate"], ["bench", "split"]])
def test_recipe_commands_without_recipe_name_only_the_recipe(command, capsys):
    """Every command taking RECIPE [key=value ...] says that RECIPE alone is missing."""
    with pytest.raises(SystemExit) as exc:
        cli.main(command)
    assert exc.value.code == 2
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last.endswith("error: the following arguments are required: RECIPE"), last


def test_rank_entry_point_without_recipe_names_only_the_recipe(capsys):
    from draftforge.train.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("the following arguments are required: RECIPE")
