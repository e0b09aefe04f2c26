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


def test_a_file_that_cannot_be_written_or_read_gives_its_path_and_cause(monkeypatch, capsys):
    """A full disk or an unusable folder ends a command with one line naming the path and the
    cause, status 2, instead of a traceback (write_atomic names the file it failed on)."""
    import errno

    import draftforge.config

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/config.yaml")

    monkeypatch.setattr(draftforge.config, "load_recipe", full_disk)
    assert cli.main(["config", "show", "recipe.yaml"]) == 2
    assert capsys.readouterr().err == (
        "draftforge config show: error: /runs/x/config.yaml: No space left on device\n")
    # an OSError without a path is a bug to see in full
    monkeypatch.setattr(draftforge.config, "load_recipe", lambda *a, **k: (_ for _ in ()).throw(OSError("?")))
    with pytest.raises(OSError):
        cli.main(["config", "show", "recipe.yaml"])


def test_train_nproc_counts_the_processes_of_this_node(capsys, monkeypatch):
    """On the 2-node recipe (world_size 16) each node starts 8 processes: --nproc 8 is accepted,
    16 refused with the number expected; the help said world_size, the check wanted 8."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    recipe = "recipes/ling3-flash-2node.yaml"
    assert cli.main(["train", recipe, "--dry-run", "--nproc", "8"]) == 0
    assert "--nproc_per_node=8" in capsys.readouterr().out
    assert cli.main(["train", recipe, "--dry-run", "--nproc", "16"]) == 2
    assert ("--nproc 16: processes on this node: split.world_size / split.num_nodes = 16 / 2 = 8 "
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "split.world_size / split.num_nodes" in " ".join(capsys.readouterr().out.split())
