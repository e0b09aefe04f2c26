"""Round 45 of regeneration: a smaller run that finds its prompts answered says that a larger
run's stopped extension (``<out>.partial``) is left beside the file."""

from __future__ import annotations

import pytest
from regenerate_helpers import SETTINGS, FakeEngine, Interrupted, make_prompts

from draftforge.data.regenerate import regenerate


def test_a_smaller_run_answered_already_names_the_larger_runs_partial_it_leaves(tmp_path, capsys):
    out = tmp_path / "answers.jsonl"
    regenerate(make_prompts(4), FakeEngine(), SETTINGS, out, progress=False)
    finished = out.read_bytes()
    with pytest.raises(Interrupted):  # a larger recipe's run, stopped after two new batches
        regenerate(make_prompts(11), FakeEngine(fail_on_call=3), SETTINGS, out, progress=False)
    partial = out.with_name(out.name + ".partial")
    assert partial.exists() and out.read_bytes() == finished
    leftover = partial.read_bytes()
    capsys.readouterr()
    engine = FakeEngine()
    report = regenerate(make_prompts(4), engine, SETTINGS, out, progress=False)
    assert (report.num_generated, report.num_reused) == (0, 4) and engine.calls == []
    err = capsys.readouterr().err
    assert "all 4 prompts already answered" in err
    assert f"{partial.name} beside it, a larger run's stopped extension, is left for that run" in err
    assert partial.read_bytes() == leftover and out.read_bytes() == finished
    # and the larger run continues from it
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, out, progress=False)
    assert not partial.exists()
