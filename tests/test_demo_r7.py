"""Review round 7, ``draftforge demo``: a run trained with the other --markov-init is named as
such (it was called another recipe's, with --force as the fix), and demo.md gives the prompts
each workload was evaluated on (it said --num-prompts where a workload has fewer)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.eval import demo, demo_state


def _finished_run(run: Path, cfg_yaml: str) -> None:
    checkpoint = run / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json"):
        (checkpoint / name).write_text("{}")
    (run / "config.yaml").write_text(cfg_yaml)


@pytest.mark.parametrize("trained_with,demo_args,fix", [
    ("bigram", ["--markov-init", "random"], "--markov-init bigram"),
    ("random", [], "--markov-init random"),  # README: demo --skip-train --num-prompts 20 after --markov-init random
])
def test_a_run_trained_with_the_other_markov_init_names_that_option(tmp_path, capsys, trained_with, demo_args, fix):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True})
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, load_recipe(recipe, demo.dspark_overrides(cfg, paths, trained_with)[0]).to_yaml())
    assert demo.main([str(recipe), "--skip-train", *demo_args]) == 2
    err = capsys.readouterr().err
    assert f"holds the DSpark run of this recipe trained with {fix}: pass {fix} to use it" in err, err
    assert "different recipe" not in err and "--force" not in err  # --force would delete a good run
    # training: the same fix first, --force only as the way to start over
    expected = load_recipe(recipe, demo.dspark_overrides(cfg, paths, "random" if trained_with == "bigram"
                                                         else "bigram")[0]).to_yaml()
    other = (fix, load_recipe(recipe, demo.dspark_overrides(cfg, paths, trained_with)[0]).to_yaml())
    with pytest.raises(demo.DemoError, match=f"trained with {fix}: pass {fix} to use it, or --retrain to "
                                             "train it again on the same answers, or --force") as info:
        demo_state.check_same_recipe(paths.run_dir, expected, "DSpark", other_option=other)
    assert info.value.exit_status == 2
    # a run of another recipe is still called one, the option or not
    edited = (fix, load_recipe(recipe, ["train.lr=0.1"]).to_yaml())
    with pytest.raises(demo.DemoError, match="holds a DSpark run of a different recipe"):
        demo_state.check_same_recipe(paths.run_dir, expected, "DSpark", other_option=edited)


def _report(prompts: dict[str, int], methods: dict[str, float]) -> dict:
    """A report.json as draftforge eval writes it; every prompt runs 4 rounds of AL ``al``."""
    return {
        "command": "draftforge eval ...", "draft": "d", "target": "random", "device": "cpu",
        "target_config": {"model": "random", "dtype": "float32", "backend": "hf", "seed": 0, "shape": None},
        "settings": {"temperature": 0.0, "max_new_tokens": 6, "verify": "full", "seed": 0},
        "block_size": 4,
        "workloads": {name: {"num_prompts": n, "prompt_digest": name, "train_time_estimate": None, "methods": {
            method: {"acceptance_length": al, "tokens_per_s": 10.0, "prompt_rounds": [4] * n,
                     "prompt_al_sum": [4 * al] * n} for method, al in methods.items()}}
                      for name, n in prompts.items()},
    }  # fmt: skip


def test_demo_md_gives_the_prompts_each_workload_ran_where_fewer_than_asked(tmp_path, capsys, monkeypatch):
    """--num-prompts 200 evaluates all 80 MT-Bench prompts (and 164 HumanEval, 100 GSM8K):
    demo.md said '200 prompts per workload'."""
    recipe = tiny_recipe(tmp_path, steps=4)
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    prompts = {"humaneval": 164, "mtbench": 80, "gsm8k": 100}
    dspark = {"humaneval": 1.5, "mtbench": 1.25, "gsm8k": 2.0}
    for folder, report in ((paths.eval_dir, {name: _report({name: n}, {"dspark": dspark[name], "ngram": 1.1,
                                                                       "none": 1.0}) for name, n in prompts.items()}),
                           (paths.dflash_eval_dir, {name: _report({name: n}, {"dspark": 1.2, "none": 1.0})
                                                    for name, n in prompts.items()})):  # fmt: skip
        merged = next(iter(report.values()))
        merged["workloads"] = {name: r["workloads"][name] for name, r in report.items()}
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(json.dumps(merged))
    # every stage is done: nothing runs
    for name in ("run_stage", "run_side_by_side"):
        monkeypatch.setattr(demo, name, lambda *a, **kw: pytest.fail("a stage ran"))
    for name in ("export_is_current", "eval_is_current", "model_card_is_current"):
        monkeypatch.setattr(demo, name, lambda *a, **kw: True)
    monkeypatch.setattr(demo, "evaluations_side_by_side", lambda threads=1: False)

    assert demo.main([str(recipe), "--skip-train", "--num-prompts", "200"]) == 0
    text = paths.table.read_text()
    assert ("prompts per workload: humaneval 164, mtbench 80, gsm8k 100 (all of a workload with fewer "
            "than the 200 asked), up to") in text
    assert "200 prompts per workload" not in text
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"export_dir={paths.export_dir} al_dspark={(1.5 + 1.25 + 2.0) / 3:.3f} "
                    "al_dflash=1.200 al_ngram=1.100")
    assert re.fullmatch(r"export_dir=\S+ al_dspark=\d+\.\d{3} al_dflash=\d+\.\d{3} al_ngram=\d+\.\d{3}", last)

    # as many as asked everywhere: the short form
    for folder in (paths.eval_dir, paths.dflash_eval_dir):
        report = json.loads((folder / "report.json").read_text())
        for entry in report["workloads"].values():
            entry["num_prompts"] = 8
            for m in entry["methods"].values():
                m["prompt_rounds"], m["prompt_al_sum"] = m["prompt_rounds"][:8], m["prompt_al_sum"][:8]
        (folder / "report.json").write_text(json.dumps(report))
    assert demo.main([str(recipe), "--skip-train", "--num-prompts", "8"]) == 0
    assert ", 8 prompts per workload, up to" in paths.table.read_text()


def test_one_new_token_is_refused_before_any_stage(tmp_path, capsys):
    """One new token is the prefill's: no verification round, so the demo ran every stage and
    printed a table of dashes and 'al_dspark=nan al_dflash=nan al_ngram=nan', exit status 0."""
    from draftforge.cli import main

    recipe = tiny_recipe(tmp_path, steps=4)
    assert main(["demo", str(recipe), "--max-new-tokens", "1"]) == 2
    assert ("draftforge demo: error: --max-new-tokens 1: the first new token comes from the prompt's "
            "prefill, so no verification round would run") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    from_recipe = tiny_recipe(tmp_path, steps=4, overrides={"eval.max_new_tokens": 1})
    assert main(["demo", str(from_recipe)]) == 2
    assert "eval.max_new_tokens: must be greater than or equal to 2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_export_that_fails_leaves_no_stamp_naming_the_old_command(tmp_path, monkeypatch):
    """The stamp says which command wrote the export folder. An export stage that replaced the
    folder and then failed (interrupted) kept the old command's stamp, so a rerun with that
    old command could skip the export over a folder the failed one wrote."""
    recipe = tiny_recipe(tmp_path, steps=4)
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    _finished_run(paths.run_dir, cfg.to_yaml())
    _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    stamp = paths.run_dir / demo_state.EXPORT_STAMP
    stamp.write_text(json.dumps({"command": ["export", "an", "earlier", "command"]}))
    monkeypatch.setattr(demo, "export_is_current", lambda *a, **kw: False)

    def run_stage(name, args, **kw):
        assert name == "export", name
        raise demo.DemoError("export interrupted", exit_status=1)

    monkeypatch.setattr(demo, "run_stage", run_stage)
    assert demo.main([str(recipe), "--skip-train"]) == 1
    assert not stamp.exists()
