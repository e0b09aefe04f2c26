"""Regressions found reviewing the round-13..16 fixes of splitserve/ and train/."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from draftforge.config import load_recipe
from draftforge.splitserve import roles

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _advice(tmp_path: Path, overrides: list[str], rank: int) -> list[str]:
    run = tmp_path / "run"
    run.mkdir()
    (run / "regenerated.jsonl").write_text("")  # what `data regenerate` leaves on the target's node
    cfg = load_recipe(str(RECIPE), [*overrides, f"train.output_dir={run}"])
    said: list[str] = []
    roles._say_how_to_resume(SimpleNamespace(cfg=cfg, rank=rank, log=said.append), None)
    return said


def test_target_node_without_trainers_does_not_say_the_run_starts_over(tmp_path):
    """On two nodes the checkpoints are written on the trainers' node only. A target rank on
    node 0 whose own train.output_dir exists (it holds the regenerated answers) but holds no
    checkpoint said "no checkpoint was written ... rerun the same command to start over",
    although node 1 may hold many: the launcher on that node (``_stop_hint``,
    ``_after_failure``) already asks whether the node runs trainers; the rank did not."""
    said = _advice(tmp_path, ["split.num_nodes=2", "split.target_ranks=[0,1]",
                              "split.trainer_ranks=[2,3]"], rank=0)
    assert len(said) == 1
    assert "start over" not in said[0]
    assert said[0].startswith("the run can be resumed")


def test_trainer_node_without_checkpoint_still_says_the_run_starts_over(tmp_path):
    """Where the node runs the trainers (one node here), an empty run folder still means a
    rerun starts over (round 16's advice, kept)."""
    said = _advice(tmp_path, [], rank=0)
    assert said == [f"no checkpoint was written in {tmp_path / 'run'} yet: rerun the same command "
                    "to start over"]
