"""Session 54: three messages a CLI review of session 53 found misleading, each said where the
user can act on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_r15 import _run

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.mark.parametrize("raw", ["", "  "])
def test_a_blank_override_says_that_nothing_follows_the_equals_sign(raw, capsys):
    """'train.output_dir=  ' said only "expected str, got null": YAML reads a blank value as null."""
    code, _, err = _run(["config", "show", RECIPE, f"train.output_dir={raw}"], capsys)
    assert code == 2, err
    assert ("train.output_dir: expected str, got null (nothing follows '=' in the override, and YAML "
            "reads a blank value as null)") in err, err


def test_a_null_written_out_gets_no_blank_value_hint(capsys):
    code, _, err = _run(["config", "show", RECIPE, "train.output_dir=null"], capsys)
    assert code == 2 and "train.output_dir: expected str, got null" in err, err
    assert "nothing follows" not in err, err


def test_the_recipe_takes_a_fractional_shard_size_as_export_does(capsys):
    """export --max-shard-size-mb 0.5 worked while export.max_shard_size_mb=0.5 was refused as no integer."""
    code, out, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=0.5"], capsys)
    assert code == 0, err
    assert "max_shard_size_mb: 0.5" in out, out
    code, _, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=0"], capsys)
    assert code == 2 and "export.max_shard_size_mb: must be greater than 0" in err, err
    # a whole number stays one (the demo's export stamp records it as written)
    code, out, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=4096"], capsys)
    assert code == 0 and "max_shard_size_mb: 4096\n" in out, out
    code, _, err = _run(["config", "show", RECIPE, "export.max_shard_size_mb=.inf"], capsys)
    assert code == 2 and ("export.max_shard_size_mb: expected int or a finite number, got float inf"
                          in err), err


@pytest.mark.parametrize("run_folder", [True, False])
def test_export_of_a_file_that_is_no_safetensors_names_what_to_pass(tmp_path, run_folder):
    """'export RUN/config.yaml' said that RUN/draft_config.json was missing."""
    from draftforge.train.export import ExportError, load_training_checkpoint

    folder = tmp_path / "run"
    (folder / "checkpoints" if run_folder else folder).mkdir(parents=True)
    given = folder / "config.yaml"
    given.write_text("train: {}\n")
    with pytest.raises(ExportError) as err:
        load_training_checkpoint(given)
    said = str(err.value)
    assert said.startswith(f"{given} is a file but no model.safetensors"), said
    if run_folder:
        assert said.endswith(f"pass the run directory {folder} for its newest complete checkpoint"), said
    else:
        assert said.endswith("pass a run directory, a checkpoint folder or a model.safetensors file"), said
    assert "draft_config.json" not in said, said


def _segments(text: str) -> list[str]:
    """What a terminal would show of ``text`` as separate writes: split at carriage returns and newlines."""
    return [part for line in text.split("\n") for part in line.split("\r")]


def test_a_rank_message_is_written_around_the_progress_bar_of_its_own_process(capsys):
    """'[rank 1 trainer] split (last interval): ...' landed on the end of the bar's line."""
    from draftforge.splitserve.roles import _say
    from draftforge.train import metrics

    bar = metrics.Progress(total=3, initial=0)
    try:
        bar.update(loss=1.0, tau=1.1, tokens=10)
        bar.bar.refresh()  # drawn, without a newline after it
        _say(1, "trainer")("split (last interval): trainer busy 100%")
    finally:
        bar.close()
    err = capsys.readouterr().err
    assert "train:" in err and "[rank 1 trainer] split" in err, err
    assert "[rank 1 trainer] split (last interval): trainer busy 100%" in _segments(err), repr(err)
    assert not metrics._ACTIVE


def test_a_rank_message_clears_the_terminal_line_another_process_may_have_drawn_on(capsys, monkeypatch):
    from draftforge.splitserve.roles import _say

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    _say(0, "target")("data finished")
    assert capsys.readouterr().err == "\r\x1b[K[rank 0 target] data finished\n"
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)  # a log file gets no escape codes
    _say(0, "target")("data finished")
    assert capsys.readouterr().err == "[rank 0 target] data finished\n"
