"""Review round 25 of ``draftforge demo`` (``eval/demo.py``): an export folder written again by
another export since the demo's, and a run of another recipe in the DFlash folder found only
after the DSpark training."""

from __future__ import annotations

import json
import shlex

import pytest
from splitserve_helpers import tiny_recipe
from test_demo_r7 import _finished_run, _report

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_stages
from draftforge.train.export import export_digest


def _stubbed_stages(monkeypatch, recipe, paths) -> list:
    """Stages that leave what the real ones leave: a training its final checkpoint, an export
    its folder (the weights of the run's final checkpoint), an evaluation its report.json.
    Returns the names of the stages run."""
    ran = []

    def export(out, weights):
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"architectures": ["Qwen3DSparkModel"]}')
        (out / "model.safetensors").write_bytes(weights)
        (out / "README.md").write_text("card")

    def run_stage(name, args, **kw):
        ran.append(name)
        if args[0] == "train":
            dflash = any(a.startswith("train.output_dir=") for a in args)
            _finished_run(paths.dflash_dir if dflash else paths.run_dir, load_recipe(recipe, list(args[2:])).to_yaml())
        elif args[0] == "export":
            export(paths.export_dir, b"weights of step 4")
            return [f"export_files={export_digest(paths.export_dir)}"]  # as draftforge export prints it

    def run_side_by_side(jobs, log_dir, *, parallel):
        ran.extend(jobs)
        for label, args in jobs.items():
            folder = paths.eval_dir if label == "eval-dspark" else paths.dflash_eval_dir
            methods = {"dspark": 1.5, "ngram": 1.1, "none": 1.0} if label == "eval-dspark" else {"dspark": 1.2,
                                                                                              "none": 1.0}
            report = _report({"humaneval": 8}, methods)
            report["command"] = "draftforge eval " + shlex.join(args[1:])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "report.json").write_text(json.dumps(report))

    monkeypatch.setattr(demo, "run_stage", run_stage)
    monkeypatch.setattr(demo, "run_side_by_side", run_side_by_side)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)
    return ran, export


def test_an_export_written_again_since_the_demos_is_exported_and_evaluated_again(tmp_path, monkeypatch, capsys):
    """``draftforge export RUN/checkpoints/step_2`` writes to RUN/export by default: a rerun of the
    demo found the folder newer than the final checkpoint and its stamp naming the demo's
    command, so it skipped the export and the evaluation, and printed the final draft's table
    and export_dir for a folder holding step 2."""
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.workloads": ["humaneval"]})
    paths = demo.demo_paths(load_recipe(recipe))
    ran, export = _stubbed_stages(monkeypatch, recipe, paths)
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert ran == ["train DSpark", "train DFlash", "export", "eval-dspark", "eval-dflash", "export (model card)"]
    # a rerun: nothing to do (the model card export rewrote the folder with the same weights)
    ran.clear()
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert ran == [], ran

    export(paths.export_dir, b"weights of step 2")  # another export since, into the same folder
    assert demo.main([str(recipe), "--num-prompts", "8"]) == 0
    assert ran == ["export", "eval-dspark", "export (model card)"], ran
    assert (paths.export_dir / "model.safetensors").read_bytes() == b"weights of step 4"
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"export_dir={paths.export_dir} al_dspark=1.500 al_dflash=1.200 al_ngram=1.100")


def test_a_dflash_folder_of_another_recipe_is_refused_before_the_dspark_training(tmp_path, monkeypatch, capsys):
    """The DSpark run folder removed to train again, the DFlash one left from a recipe since
    edited: the demo trained DSpark (18 minutes on the CPU recipe, after the 11 of the
    regeneration) and only then refused the DFlash folder, advising --force, which deletes
    the DSpark run it had just trained."""
    recipe = tiny_recipe(tmp_path, steps=4)
    paths = demo.demo_paths(load_recipe(recipe))
    _finished_run(paths.dflash_dir, load_recipe(recipe, [*demo.dflash_overrides(paths), "train.lr=0.001"]).to_yaml())
    ran, _ = _stubbed_stages(monkeypatch, recipe, paths)
    assert demo.main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{paths.dflash_dir} holds a DFlash run of a different recipe" in err and "'lr: 0.001'" in err
    assert ran == [] and not paths.run_dir.exists()


@pytest.mark.parametrize("folder", ["exp #3", "a: b", "plain folder"])
def test_the_dflash_overrides_name_run_folders_whose_paths_yaml_would_misread(tmp_path, folder):
    """The DFlash training's overrides held its folder and the answers' file as bare YAML:
    under '/x/exp #3/' it trained into '/x/exp' (the rest a comment) and read '/x/exp' as its
    answers; under '/x/a: b/' the demo stopped on an override the user never typed."""
    base = tmp_path / folder
    base.mkdir()
    recipe = tiny_recipe(base, steps=4, overrides={"data.regenerate": True})
    paths = demo.demo_paths(load_recipe(recipe))
    assert paths.dflash_dir == base / "run-dflash" and paths.data_file == base / "run" / "regenerated.jsonl"
    ablation = load_recipe(recipe, demo.dflash_overrides(paths))  # what draftforge train makes of them
    assert ablation.train.output_dir == str(base / "run-dflash")
    assert ablation.data.regenerated_file == str(base / "run" / "regenerated.jsonl")


def test_a_failed_evaluation_says_how_to_continue(tmp_path, monkeypatch):
    """A failed training stage said 'fix it and rerun the demo (finished stages are skipped)';
    a failed evaluation gave its status and log only, not what to run next."""
    import sys

    monkeypatch.setattr(demo_stages, "draftforge_command",
                        lambda *args: [sys.executable, "-c", f"import sys; sys.exit({args[0]})"])
    with pytest.raises(demo.DemoError) as info:
        demo_stages.run_side_by_side({"eval-dspark": ["0"], "eval-dflash": ["1"]}, tmp_path / "logs", parallel=True)
    assert str(info.value) == (
        f"evaluation failed: 'eval-dflash' exited with status 1, log {tmp_path / 'logs' / 'eval-dflash.log'}\n"
        "The logs say why; fix it and rerun the demo (finished stages are skipped, and so is an "
        "evaluation that finished).")
    assert info.value.exit_status == 1
