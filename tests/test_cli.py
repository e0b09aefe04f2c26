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
