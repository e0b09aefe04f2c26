"""Session 55: what a CLI review found the commands accepting or advising wrongly, each said
where the user can act on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from dspark_helpers import tiny_draft
from test_cli_r15 import _run
from test_export_r12 import _checkpoint

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


@pytest.mark.parametrize(("key", "said"), [
    ("target.model", "target.model: is empty: give a registered name (smollm2-135m-instruct), 'random' "
                     "or a local HF folder"),
    ("target.cache_dir", "target.cache_dir: is empty: give a folder, or leave it out for "
                         "$DRAFTFORGE_CACHE (else ~/.cache/draftforge)"),
    ("train.resume", "train.resume: is empty: give auto, never or a checkpoint's path"),
    ("export.out_dir", "export.out_dir: is empty: give a folder, or leave it out for "
                       "<train.output_dir>/export"),
])
@pytest.mark.parametrize("blank", ['""', "' '"])
def test_a_blank_path_or_name_is_refused_at_its_key(key, said, blank, capsys):
    """'' was taken: target.model blamed draft.max_position_embeddings at the draft section's
    line, cache_dir converted the target into the current directory (517 MB), resume read the
    checkpoint '.', and export.out_dir exported into the current directory."""
    code, _, err = _run(["config", "show", RECIPE, f"{key}={blank}"], capsys)
    assert code == 2, err
    assert f"{key}={blank}" in err and f": {said}\n" in err, err


@pytest.mark.parametrize("out", ["run", ".", "run/checkpoints", "run/checkpoints/step_00000004"])
@pytest.mark.parametrize("given", ["run", "run/checkpoints/step_00000004",
                                   "run/checkpoints/step_00000004/model.safetensors"])
def test_export_refuses_an_out_that_is_or_holds_what_it_exports(tmp_path, monkeypatch, capsys, out, given):
    """'export RUN --out RUN' said the folder was no export and to empty it first: the
    checkpoints being exported. Refused up front, naming the default instead."""
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    code, _, err = _run(["export", given, "--out", out], capsys)
    assert code == 2, err
    what = "run" if out in ("run", ".") else "checkpoint"
    relation = "is" if out in ("run", "run/checkpoints/step_00000004") else "holds"
    assert f"--out {out} {relation} the {what} being exported" in err, err
    # a run directory given is named as given; a checkpoint's run is found from where it lies
    default = "run/export" if given == "run" else f"{tmp_path / 'run'}/export"
    assert f"so choose a folder outside it (by default {default})" in err, err
    assert not (tmp_path / "run" / "export").exists()
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "model.safetensors").is_file()


def test_export_into_a_folder_inside_the_run_still_works(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    code, out, err = _run(["export", "run", "--out", "run/elsewhere"], capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "elsewhere" / "config.json").is_file()


@pytest.mark.parametrize("name", ["answers.txt", "folder", "answers.jsonl"])
def test_train_advises_writing_the_answers_file_only_where_data_regenerate_would(tmp_path, capsys, name):
    """A missing data.regenerated_file was answered 'no such file. Write it first with draftforge
    data regenerate', which then refused the same path (a .txt name, or a folder that does exist)."""
    given = tmp_path / name
    if name == "folder":
        given.mkdir()
    code, _, err = _run(["train", RECIPE, "--dry-run", f"train.output_dir={tmp_path / 'run'}",
                         f"data.regenerated_file={given}"], capsys)
    assert code == 2, err
    if name == "answers.txt":
        assert (f"data.regenerated_file {given}: the answers are written as plain JSON lines, which "
                "training reads only from a file whose name ends in .jsonl") in err, err
    elif name == "folder":
        assert f"data.regenerated_file {given} is a folder; give a .jsonl file path" in err, err
    else:
        assert f"data.regenerated_file {given}: no such file. Write it first with 'draftforge data " \
               "regenerate RECIPE'" in err, err
    if name != "answers.jsonl":
        assert "Write it first" not in err, err


def test_answers_of_another_random_target_name_its_seed_not_target_model(tmp_path):
    """Answers of the random target at seed 0 read with seed 7 said '(or restore target.model)',
    which was unchanged: the seed (or shape) is what differs. A folder's answers name its files."""
    import json

    from draftforge.data.formats import Conversation
    from draftforge.data.regenerate import RegenerationError, check_answers
    from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
    from draftforge.splitserve.target import target_name

    shape = TargetShape(num_hidden_layers=2, hidden_size=64, vocab_size=300, max_position_embeddings=512,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    written, reading = (target_name(TargetConfig(model="random", seed=seed, shape=shape)) for seed in (0, 7))
    settings = GenerationConfig()
    prompt = Conversation(id="p0", messages=[{"role": "user", "content": "hi"}])
    row = {"id": "p0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
           "target": str(written), "target_fingerprint": written.fingerprint,
           "generation": settings.model_dump()}
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps(row) + "\n")
    check_answers(path, [prompt], settings, written)  # the writer's own target reads them
    with pytest.raises(RegenerationError) as err:
        check_answers(path, [prompt], settings, reading)
    assert str(err.value).endswith("move it away and rerun to answer with this target (or restore "
                                   "target.seed and target.shape)"), err.value
    folder = target_name(TargetConfig(model=str(tmp_path / "final")))
    row.update(target=str(folder), target_fingerprint="sha256:0")
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(RegenerationError) as err:
        check_answers(path, [prompt], settings, type(folder)(str(folder), "sha256:1"))
    assert str(err.value).endswith("(or point target.model at the folder that wrote it: the config, "
                                   "tokenizer or weights of this one differ)"), err.value


@pytest.mark.parametrize("skip_train", [False, True])
def test_demo_refuses_an_export_out_dir_export_would_refuse_before_any_stage(
        tmp_path, monkeypatch, capsys, skip_train):
    """Without --force the demo regenerated and trained both drafts, then stage 4 refused the
    recipe's export.out_dir (an eval report folder here), saying '--out', which the demo has not."""
    from splitserve_helpers import tiny_recipe
    from test_demo_r7 import _finished_run
    from test_demo_r45 import _no_stages

    from draftforge.config import load_recipe
    from draftforge.eval import demo

    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "report.md").write_text("| workload |\n")
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"export.out_dir": str(reports)})
    paths = demo.demo_paths(load_recipe(recipe))
    if skip_train:
        _finished_run(paths.run_dir, load_recipe(recipe).to_yaml())
        _finished_run(paths.dflash_dir, load_recipe(recipe, demo.dflash_overrides(paths)).to_yaml())
    _no_stages(monkeypatch)  # a stage that ran would exit 1
    assert demo.main([str(recipe), *(["--skip-train"] if skip_train else [])]) == 2
    err = capsys.readouterr().err
    assert (f"the export stage would replace {reports} (export.out_dir): export destination {reports} is a "
            "non-empty folder that is not an export") in err, err
    assert "set another export.out_dir" in err and "--out" not in err, err
    assert (reports / "report.md").is_file()


def test_export_names_a_file_in_its_out_path_before_reading_weights(tmp_path, monkeypatch, capsys):
    """'--out RECIPE.yaml/sub' said '[Errno 17] File exists ... Free space (or choose another
    --out) and rerun': a full disk was not the problem."""
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    (tmp_path / "notes.txt").write_text("x")
    code, _, err = _run(["export", "run", "--out", "notes.txt/sub"], capsys)
    assert code == 2, err
    assert (f"--out notes.txt/sub: {tmp_path / 'notes.txt'} is a file, not a folder, so nothing can be "
            "written under it") in err, err
    assert "Free space" not in err, err


def test_an_export_write_failing_for_another_reason_than_space_does_not_advise_freeing_it(
        tmp_path, monkeypatch, capsys):
    import errno
    import os

    import safetensors.torch

    def denied(tensors, filename, *args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), filename)

    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    monkeypatch.setattr(safetensors.torch, "save_file", denied)
    code, _, err = _run(["export", "run", "--out", "out"], capsys)
    assert code == 2, err
    assert "Permission denied" in err and err.rstrip().endswith("Choose another --out and rerun"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", ["declared", "null"])
def test_a_draft_folder_given_as_the_target_is_named_a_draft(tmp_path, capsys, shape):
    """An export as target.model read as a 1-layer target ('the target has 1 layers, ids 0..0'),
    or with target.shape declared blamed draft.max_position_embeddings at the draft's line."""
    import json

    draft = tmp_path / "export"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3DSparkModel"], "block_size": 4, "target_layer_ids": [0, 1, 2],
        "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 49152}))
    extra = ["target.shape=null"] if shape == "null" else []
    code, _, err = _run(["config", "show", RECIPE, f"target.model={draft}", *extra], capsys)
    assert code == 2, err
    assert (f"target.model: {draft} is a draft (its config.json has block_size and target_layer_ids, "
            "architectures ['Qwen3DSparkModel']), not a target model: name the model the draft "
            "speculates for (target.model, or eval's --target)\n") in err, err
    assert "max_position_embeddings" not in err and "declare the target's shape" not in err, err


def test_eval_names_a_draft_given_as_its_target(tmp_path):
    import json

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.registry import DraftNotTarget, resolve_target_shape

    draft = tmp_path / "export"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"block_size": 8, "target_layer_ids": [1]}))
    with pytest.raises(DraftNotTarget, match=rf"^{tmp_path}/export is a draft \(its config.json has "
                       r"block_size and target_layer_ids\), not a target model"):
        resolve_target_shape(TargetConfig(model=str(draft)))


def test_a_prompt_too_long_says_how_far_to_lower_max_new_tokens_or_that_it_cannot_help():
    """'2050 prompt tokens + --max-new-tokens 2 exceed ... 2048; lower --max-new-tokens' could
    not help: 2 is the least that runs a round."""
    from draftforge.errors import InputError
    from draftforge.eval.harness import check_prompt_lengths

    def where(index):
        return f"p:{index + 1}"

    check_prompt_lengths([[1] * 10], 6, 16, where, option="--max-new-tokens")  # 16 fit exactly
    with pytest.raises(InputError) as err:
        check_prompt_lengths([[1] * 10], 7, 16, where, option="--max-new-tokens")
    assert str(err.value) == ("p:1: 10 prompt tokens + --max-new-tokens 7 exceed the draft's "
                              "max_position_embeddings 16; lower --max-new-tokens to 6 or less, or "
                              "leave the prompt out")
    with pytest.raises(InputError) as err:
        check_prompt_lengths([[1] * 15], 2, 16, where, option="--max-new-tokens", whose="target's")
    assert str(err.value) == ("p:1: 15 prompt tokens + --max-new-tokens 2 exceed the target's "
                              "max_position_embeddings 16; the prompt alone leaves no room for a "
                              "verification round: leave it out")


@pytest.mark.parametrize("under", [False, True])
def test_a_dangling_link_as_the_run_folder_is_refused_before_anything_starts(tmp_path, capsys, under):
    """train.output_dir a symbolic link to nothing passed the checks; the target loaded, then the
    trainer failed with 'cannot create or lock .../.train.lock: File exists'."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone" / "zz")
    run = link / "sub" if under else link
    code, _, err = _run(["train", RECIPE, "--dry-run", f"train.output_dir={run}"], capsys)
    assert code == 2, err
    where = f"is under {link}," if under else "is"
    assert (f"train.output_dir: {run} {where} a symbolic link to nothing ({tmp_path / 'gone' / 'zz'}); "
            "name a folder for the run") in err, err
    assert not (tmp_path / "gone").exists()


def test_export_refuses_a_dangling_link_as_its_out(tmp_path, monkeypatch, capsys):
    """It followed the link and made the folders it points to, wherever they were."""
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "zz")
    code, _, err = _run(["export", "run", "--out", "dangling"], capsys)
    assert code == 2, err
    assert f"--out dangling is a symbolic link to nothing ({tmp_path / 'gone' / 'zz'}); give a folder" in err, err
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize("marker", [None, "run.json", "config.yaml", "checkpoints"])
def test_train_refuses_a_folder_whose_run_files_no_run_wrote(tmp_path, capsys, marker):
    """A folder holding the user's own metrics.jsonl and accounting.jsonl: the run replaced the
    first and appended its records to the second."""
    run = tmp_path / "mixed"
    run.mkdir()
    (run / "metrics.jsonl").write_text("garbage\n")
    (run / "accounting.jsonl").write_text("my data\n")
    if marker == "checkpoints":
        (run / marker).mkdir()
    elif marker is not None:  # a run started here: its records are its own to continue
        (run / marker).write_text("{}\n" if marker == "run.json" else "name: x\n")
    code, _, err = _run(["train", RECIPE, "--dry-run", f"train.output_dir={run}"], capsys)
    if marker is not None:
        assert "no run wrote them" not in err, err
        return
    assert code == 2, err
    assert (f"train.output_dir: {run} holds metrics.jsonl, accounting.jsonl but no run.json, so no run "
            "wrote them, and a run would replace or append to them: move them away or name another "
            "folder for the run") in err, err
    assert (run / "accounting.jsonl").read_text() == "my data\n"


@pytest.mark.parametrize("kind", ["export", "run"])
def test_eval_refuses_an_out_that_is_a_model_folder_or_a_run(tmp_path, capsys, kind):
    """eval --out OTHER_EXPORT put its report among that export's files (a later export there was
    then refused), and --out RUN among the run's own records."""
    from draftforge.eval.cli import _check_output_paths

    folder = tmp_path / kind
    folder.mkdir()
    if kind == "export":
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
    else:
        (folder / "checkpoints").mkdir()
    from draftforge.errors import InputError

    with pytest.raises(InputError) as err:
        _check_output_paths(str(folder), None)
    if kind == "export":
        assert str(err.value) == (f"--out {folder}: is a model folder (config.json and its weights); the "
                                  "report would sit among its files (and an export there would then refuse "
                                  f"to replace it): give a folder of its own, e.g. {tmp_path / 'export-eval'}")
    else:
        assert str(err.value) == (f"--out {folder}: is a training run's folder; give a folder of its own "
                                  f"for the report, e.g. {folder / 'eval'} (where the demo writes a run's "
                                  "report and draftforge export looks for one; eval's own default is runs/eval)")
    _check_output_paths(str(folder / "eval"), None)  # a folder inside a run is accepted


def test_eval_out_that_is_the_runs_checkpoints_folder_is_called_that_not_inside_it(tmp_path):
    """'--out RUN/checkpoints' said 'is inside RUN/checkpoints': it is that folder."""
    from types import SimpleNamespace

    from draftforge.errors import InputError
    from draftforge.eval.cli import _check_outputs_spare_inputs

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    args = SimpleNamespace(draft=str(run), out=str(run / "checkpoints"), calibrate=None)
    with pytest.raises(InputError) as err:
        _check_outputs_spare_inputs(args)
    assert str(err.value).startswith(f"--out {run / 'checkpoints'}: is {run / 'checkpoints'}, the draft's "
                                     "own files; the report would be written among them"), err.value


@pytest.mark.parametrize(("line", "kind"), [('[{"workload": "w", "input_ids": [1, 2]}]', "an array"),
                                            ('"abc"', "a string"), ("7", "a JSON 7")])
def test_a_prompts_file_row_that_is_no_object_is_called_that(tmp_path, line, kind):
    """An array or a string as a row said 'input_ids must be a list of token ids, got null'."""
    from draftforge.errors import InputError
    from draftforge.eval.cli import _prompts_from_file

    path = tmp_path / "p.jsonl"
    path.write_text('{"workload": "w", "input_ids": [1]}\n' + line + "\n")
    with pytest.raises(InputError) as err:
        _prompts_from_file(str(path), None)
    assert str(err.value) == (f"{path}:2: not a prompt row ({kind}, not an object); expected "
                              "{'workload': str, 'input_ids': [int, ...]}"), err.value


def test_export_without_out_of_what_is_no_checkpoint_says_what_it_is(tmp_path, monkeypatch, capsys):
    """'export EXPORT' (or an empty folder) said 'give --out DIR'; with --out it then said
    what was wrong with the source. The source is named first; a lone checkpoint asks for --out."""
    import shutil

    monkeypatch.chdir(tmp_path)
    step = _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    (tmp_path / "empty").mkdir()
    code, _, err = _run(["export", "empty"], capsys)
    assert code == 2 and "empty: no model.safetensors found in it and no checkpoints/ folder" in err, err
    assert _run(["export", "run", "--out", "exp"], capsys)[0] == 0
    code, _, err = _run(["export", "exp"], capsys)
    assert code == 2 and "exp: an export (it holds config.json, not draft_config.json)" in err, err
    lone = tmp_path / "lone"
    lone.mkdir()
    for name in ("model.safetensors", "draft_config.json"):
        shutil.copy(step / name, lone / name)
    code, _, err = _run(["export", "lone"], capsys)
    assert code == 2 and "give --out DIR (no recipe or run directory to derive it from)" in err, err


def test_resume_from_an_export_is_named_an_export(tmp_path, monkeypatch, capsys):
    """train.resume=EXPORT said 'not a complete checkpoint (no COMPLETE marker)'."""
    monkeypatch.chdir(tmp_path)
    _checkpoint(tmp_path / "run", 4, tiny_draft(seed=1))
    assert _run(["export", "run", "--out", "exp"], capsys)[0] == 0
    code, _, err = _run(["train", RECIPE, "--dry-run", f"train.output_dir={tmp_path / 'new'}",
                         "train.resume=exp"], capsys)
    assert code == 2, err
    assert ("train.resume: exp is an export (config.json), not a training checkpoint: an export has no "
            "optimiser, scheduler or data cursor to resume from") in err, err


def test_a_file_that_is_no_safetensors_is_refused_in_words_that_fit_eval_too(tmp_path):
    """'draftforge eval RECIPE.yaml' said '(export reads a draft's weights from safetensors only)'."""
    from draftforge.train.export import ExportError, load_training_checkpoint

    given = tmp_path / "recipe.yaml"
    given.write_text("train: {}\n")
    with pytest.raises(ExportError, match=r"\(draftforge reads a draft's weights from safetensors only\)"):
        load_training_checkpoint(given)


def test_more_workers_than_batches_are_not_promised():
    """'--workers 100' for one batch printed '100 workers of 1 thread(s) each'; one was started."""
    from draftforge.data.regenerate import worker_plan

    cpu = dict(device="cpu", backend="hf")
    assert worker_plan(100, None, cores=2, num_batches=1, **cpu) == (1, 2)
    assert worker_plan(100, 1, cores=2, num_batches=3, **cpu) == (3, 1)
    assert worker_plan(2, None, cores=2, num_batches=40, **cpu) == (2, 1)


def test_llamacpp_json_over_what_the_run_reads_is_refused_before_any_work(tmp_path):
    """--json RECIPE or --json EXPORT/config.json was written over after the first prompt."""
    import json

    from draftforge.errors import InputError
    from draftforge.eval.llamacpp_check import main as llamacpp_check_main

    export = tmp_path / "export"
    export.mkdir()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: x\n")
    base = [str(export), "--recipe", str(recipe)]
    with pytest.raises(InputError, match=rf"^--json {recipe}: is the --recipe file, which this run reads"):
        llamacpp_check_main([*base, "--json", str(recipe)])
    with pytest.raises(InputError, match=rf"^--json {export}/config.json: is inside the export {export}, whose "
                       rf"files this run reads; give a path outside it, e.g. {tmp_path}/llamacpp.json"):
        llamacpp_check_main([*base, "--json", str(export / "config.json")])
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    with pytest.raises(InputError, match=r"an existing file that is not an earlier --json"):
        llamacpp_check_main([*base, "--json", str(notes)])
    earlier = tmp_path / "earlier.json"  # an earlier run's: rewritten, so the checks go on to the export
    earlier.write_text(json.dumps([{"workload": "w", "index": 0, "llamacpp": {}, "draftforge": {}}]))
    with pytest.raises(InputError, match=r"not an export folder \(no config.json\)"):
        llamacpp_check_main([*base, "--json", str(earlier)])


def test_a_file_key_at_odds_with_an_override_names_the_override_too(capsys):
    """'target=null' was reported as 'tiny-debug.yaml:26: draft.hidden_size: 64 differs from the
    target's hidden_size 576': the override that brought it about was not named."""
    lines = RECIPE.read_text().splitlines()
    number = next(n for n, text in enumerate(lines, 1) if text.strip().startswith("hidden_size: 64")
                  and lines[n - 2].strip() == "draft:")
    code, _, err = _run(["config", "show", RECIPE, "target=null"], capsys)
    assert code == 2, err
    assert (f"{RECIPE}:{number} (with command line 'target=null'): draft.hidden_size: 64 differs from the "
            "target's hidden_size 576") in err, err
    code, _, err = _run(["config", "show", RECIPE], capsys)
    assert code == 0 and "with command line" not in err, err


def test_a_run_that_ran_out_of_data_rerun_with_the_same_recipe_starts_no_rank(tmp_path):
    """Rerunning a run stopped by data_exhausted loaded the target and started every rank, only to
    stop at the same step; with more data (split.max_epochs raised) it trains on."""
    import subprocess
    import sys

    from splitserve_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path, steps=20, overrides={"data.num_samples": 2, "split.max_epochs": 1})

    def train(*overrides):
        done = subprocess.run([sys.executable, "-m", "draftforge", "train", str(recipe), *overrides],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    first = train()
    assert "stop: data_exhausted" in first, first[-2000:]
    run = tmp_path / "run"
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "run.json", "summary.json")}
    again = train()
    assert (f"draftforge train: nothing to train: the run in {run} stopped at step 1 of 20 when its data "
            "ran out (summary.json: data_exhausted), with this same recipe") in again, again[-2000:]
    assert "[rank" not in again
    assert {name: (run / name).read_bytes() for name in before} == before
    more = train("split.max_epochs=2")
    assert "nothing to train" not in more and "training summary: step 2/20" in more, more[-2000:]


@pytest.mark.parametrize("reuse", [False, True])
def test_a_target_stops_computing_features_within_the_chunk_once_every_trainer_stopped(tmp_path, reuse):
    """After the trainers' last step the target finished every feature batch of the chunk it was
    on (seconds each at the CPU recipe's shapes) before it saw the stop, and sent one sample."""
    from test_reuse_r54 import _stream

    # chunks of 4 conversations, feature batches of 3 rows: a stop after the first batch's 3 rows
    samples, rows, source = _stream(tmp_path, reuse=reuse, stop_after=3)
    assert rows == 3, rows  # the chunk's second batch is not computed
    assert samples == [] and not source._kept


@pytest.mark.parametrize("resume", ["never", "named"])
def test_the_stop_advice_says_the_same_command_is_refused_once_the_run_saved_past_its_start(tmp_path, resume):
    """After Ctrl-C the launcher said 'with train.resume=never the same command starts over'; the
    run already held checkpoints, so the same command was refused."""
    from splitserve_helpers import tiny_recipe
    from test_launch_r11 import _checkpoint as run_checkpoint

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import _not_auto_advice

    run = tmp_path / "run"
    named = run_checkpoint(tmp_path / "other", 2)
    setting = "never" if resume == "never" else str(named)
    cfg = load_recipe(tiny_recipe(tmp_path, steps=8), [f"train.resume={setting}"])
    before = _not_auto_advice(cfg)  # nothing saved yet: the same command does what it says
    assert before.startswith(f"With train.resume={setting} the same command "), before
    assert "now refused" not in before
    newest = run_checkpoint(run, 4)
    after = _not_auto_advice(cfg)
    assert after == (f"With train.resume={setting} the same command is now refused ({run} holds "
                     f"step_00000004, later than where it would start); rerun with train.resume=auto in place of "
                     f"'train.resume={setting}' to "
                     f"continue from {newest}."), after


def test_a_resume_on_answers_of_the_other_source_is_noted(tmp_path):
    """A run trained on inline answers, resumed once a regenerated file had appeared (or the
    reverse), trained on other answers without a word; the launch did not say which it used."""
    import json

    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import Preflight, answers_note

    cfg = load_recipe(tiny_recipe(tmp_path, steps=8, overrides={"data.regenerate": True}))
    run = Path(cfg.train.output_dir)
    run.mkdir(parents=True)
    answers = run / "regenerated.jsonl"
    fresh = answers_note(cfg, Preflight(regenerate=True))
    assert fresh == ("draftforge train: answers: the target answers the prompts during training "
                     f"(no {answers} yet)")
    (run / "run.json").write_text(json.dumps({"segments": [{"answers": "inline"}]}))
    resumed = Preflight(regenerate=False, resume_from=run / "checkpoints" / "step_00000002", resume_step=2)
    assert answers_note(cfg, resumed) == (
        f"draftforge train: answers: read from {answers}\n"
        "note: the run's last segment trained on answers the target gave during training: the steps "
        f"after step 2 train on other answers than the checkpointed run's (move {answers} away to "
        "continue it on its own)")
    (run / "run.json").write_text(json.dumps({"segments": [{"answers": str(answers)}]}))
    assert answers_note(cfg, resumed) == f"draftforge train: answers: read from {answers}"  # the same
    inline = Preflight(regenerate=True, resume_from=resumed.resume_from, resume_step=2)
    assert answers_note(cfg, inline).endswith(f"(restore {answers} to continue it on its own)")
    (run / "run.json").write_text(json.dumps({"segments": [{}]}))  # an earlier draftforge's record
    assert "note" not in answers_note(cfg, inline)


def test_a_trainers_run_json_records_the_answers_it_trains_on(monkeypatch, tmp_path):
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import ANSWERS_SOURCE_ENV
    from draftforge.splitserve.roles import _answers_details

    cfg = load_recipe(tiny_recipe(tmp_path, steps=8, overrides={"data.regenerate": True}))
    monkeypatch.delenv(ANSWERS_SOURCE_ENV, raising=False)
    assert _answers_details(cfg) == {}  # torchrun by hand: each rank decided for itself
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "inline")
    assert _answers_details(cfg) == {"answers": "inline"}
    monkeypatch.setenv(ANSWERS_SOURCE_ENV, "file")
    assert _answers_details(cfg) == {"answers": str(Path(cfg.train.output_dir) / "regenerated.jsonl")}
