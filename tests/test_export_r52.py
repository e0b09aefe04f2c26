"""Session 52: ``export RUN`` takes one checkpoint. It resolved the run's newest checkpoint three
times (for the card's recipe, for the acceptance report, for the weights), so a save that
completed in between gave a card describing one checkpoint beside another one's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_helpers import tiny_eval_draft, tiny_target
from safetensors.torch import load_file
from splitserve_helpers import tiny_recipe
from test_export import _write_checkpoint

from draftforge.train import export as export_module
from draftforge.train.export import draft_fingerprint, load_training_checkpoint


def checkpoint_fingerprint(checkpoint: Path) -> str:
    """What an evaluation of ``checkpoint`` records as its draft_fingerprint."""
    return draft_fingerprint(load_training_checkpoint(checkpoint)[1])


def test_a_save_during_export_does_not_mix_two_checkpoints(tmp_path, monkeypatch, capsys):
    from draftforge.cli import main
    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import _model_config
    from draftforge.train.model import DSparkConfig, DSparkDraft

    recipe = tiny_recipe(tmp_path)
    draft = DSparkDraft(DSparkConfig(**_model_config(load_recipe(recipe))))
    run = tmp_path / "run"
    steps = {}
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:08d}"
        _write_checkpoint(folder, draft)
        (folder / "recipe.yaml").write_text(Path(recipe).read_text() + f"name: segment{step}\n")
        (folder / "trainer_state.json").write_text("{}")
        (folder / "COMPLETE").touch()
        steps[step] = folder
        with torch.no_grad():
            draft.fc.weight.add_(0.01)  # the next step's weights differ
    (run / "eval").mkdir()
    (run / "eval" / "report.md").write_text("| workload | AL |\n|---|---|\n| w | 1.50 |\n")
    (run / "eval" / "report.json").write_text(json.dumps(
        {"draft_path": str(run), "draft_fingerprint": checkpoint_fingerprint(steps[2])}))

    looks = []

    def newest_then_a_later_save(run_dir):  # step 4 completes just after export's first look
        looks.append(run_dir)
        return steps[2] if len(looks) == 1 else steps[4]

    monkeypatch.setattr(export_module, "latest_checkpoint", newest_then_a_later_save)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    _, state = load_training_checkpoint(steps[2])
    assert torch.equal(exported["fc.weight"], state["fc.weight"].to(exported["fc.weight"].dtype))
    assert f"model card: recipe from {steps[2] / 'recipe.yaml'}" in out
    assert f"model card: acceptance table from {run / 'eval' / 'report.md'}" in out
    card = (tmp_path / "out" / "README.md").read_text()
    assert "name: segment2" in card and "| w | 1.50 |" in card


@pytest.mark.parametrize("with_on_end", [False, True])
def test_training_holds_the_run_folder_until_its_summary_and_accounting_are_written(tmp_path, monkeypatch, with_on_end):
    """The trainer let go of RUN/.train.lock before writing summary.json, and the trainer rank
    appended the accounting summary after that: a next run in the folder could start between."""
    import errno
    import fcntl

    from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

    from draftforge.train import checkpoint as ckpt
    from draftforge.train import trainer as trainer_module
    from draftforge.train.sample import pack
    from draftforge.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                      train=train_config(str(run), steps=2, checkpoint_interval=2), embeddings=target_embeddings(),
                      run_dir=run, recipe_yaml="name: r\n")

    def taken() -> bool:  # another open file's flock, as a second run's would be
        with open(run / ckpt.RUN_LOCK, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                assert err.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False

    seen = {}
    write_summary = trainer_module.write_summary

    def writing_summary(run_dir, summary):
        seen["held while summary.json is written"] = taken()
        write_summary(run_dir, summary)

    def on_end(result):
        seen["summary"] = (run / "summary.json").is_file()
        seen["held at on_end"] = taken()
        seen["step"] = result.step

    monkeypatch.setattr(trainer_module, "write_summary", writing_summary)
    trainer.resume()
    trainer.fit(pack(chain_samples(12), 90), **({"on_end": on_end} if with_on_end else {}))
    assert seen.pop("held while summary.json is written") is True
    if with_on_end:
        assert seen == {"summary": True, "held at on_end": True, "step": 2}
    assert not taken()  # and let go after it


def test_an_export_replaced_while_eval_reads_it_is_refused_not_mixed(tmp_path):
    """eval reads an export's config.json, loads the target, then reads the weights: an export
    into the same folder in between gave one export's config with the other's weights."""
    from draftforge.errors import InputError
    from draftforge.eval.cli import _draft_loader
    from draftforge.train.export import export_draft

    target = tiny_target()
    out = tmp_path / "export"
    export_draft(tiny_eval_draft(target, seed=1), out, progress=lambda _: None)
    _, load, _ = _draft_loader(str(out))
    assert torch.equal(load(target, "cpu").fc.weight, tiny_eval_draft(target, seed=1).fc.weight)  # undisturbed
    _, load, _ = _draft_loader(str(out))
    export_draft(tiny_eval_draft(target, seed=2, block_size=3), out, progress=lambda _: None)  # the next export
    with pytest.raises(InputError, match=r"was replaced \(by another 'draftforge export'\?\) while this evaluation read it"):
        load(target, "cpu")


def test_export_of_a_run_whose_checkpoint_is_pruned_while_read_takes_the_newer_one(tmp_path, monkeypatch, capsys):
    """Resolving the checkpoint once (above) named it directly to the loader, which does not swap
    a named checkpoint: 'export RUN' failed where it read the newer one before."""
    from test_export import tiny_draft
    from test_export_r12 import _checkpoint, _prune_on_first_read

    from draftforge.train.export_cli import main

    run, old, new = tmp_path / "run", tiny_draft(seed=1), tiny_draft(seed=2)
    _checkpoint(run, 4, old)
    _prune_on_first_read(monkeypatch, run, new)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "export: step_00000004 was removed while it was read" in out
    assert f"export: {run / 'checkpoints' / 'step_00000006'} -> {tmp_path / 'out'}" in out
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], new.fc.weight.to(exported["fc.weight"].dtype))
