"""`draftforge eval DRAFT --target T` without --recipe rendered the workloads with the default
target.generation (thinking off, the tokenizer's own template), whatever the draft was trained
with: a draft trained against a Qwen3-style target with enable_thinking true was measured on
prompts unlike its training's, silently (review round 60). Round 60 refused such a draft; that
also refused drafts whose template ignores the setting (SmolLM2's) and tokenizers holding a
dict of named templates, and an export had no recipe file to pass. Now the settings the
draft's saved training recipe records (a checkpoint's recipe.yaml, its run's config.yaml, an
export's model card) render the workloads, and which were used is said and recorded."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from eval_helpers import (
    LAYER_IDS,
    SHAPE,
    random_prompts,
    tiny_debug_recipe,
    tiny_eval_draft,
    tiny_target,
)

from draftforge.config import load_recipe
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.random_target import random_llama
from draftforge.train.export import ModelCard, export_draft


@pytest.fixture
def recipe_path(tmp_path):
    """tiny-debug with the eval helpers' 512-token vocabulary."""
    return tiny_debug_recipe(tmp_path)


@pytest.fixture
def target_dir(tmp_path):
    """A local target folder of the helpers' shape: its config.json is all eval reads before loading it."""
    folder = tmp_path / "target"
    random_llama(SHAPE, seed=0).config.save_pretrained(folder)
    return folder


class TargetLoaded(Exception):
    """Raised where the target would load: the checks before it all passed."""


@pytest.fixture
def no_target(monkeypatch):
    def stop(*args, **kwargs):
        raise TargetLoaded

    monkeypatch.setattr("draftforge.splitserve.target.build_target", stop)


class Rendered(Exception):
    """Raised by :class:`Tokenizer` at the first prompt rendered, with the arguments it got."""


class Tokenizer:
    """A tokenizer whose chat template is a dict of named templates (as some models ship), and
    which stops the evaluation at the first prompt it is asked to render."""

    chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools }}"}

    def apply_chat_template(self, messages, **kwargs):
        raise Rendered(kwargs)


@pytest.fixture
def rendering_target(monkeypatch, target_dir):
    """The evaluation runs up to the first prompt rendered, which raises :class:`Rendered`."""
    target = HFTarget(tiny_target().model, Tokenizer(), LAYER_IDS, name=str(target_dir))
    monkeypatch.setattr("draftforge.splitserve.target.build_target", lambda *args, **kwargs: target)


def _recipe_yaml(recipe_path: Path, *, thinking: bool, template: str | None = None) -> str:
    """The resolved recipe a run saves, with target.generation's thinking mode and template set."""
    recipe = load_recipe(recipe_path)
    generation = recipe.target.generation.model_copy(update={"enable_thinking": thinking,
                                                             "chat_template": template})
    return recipe.model_copy(update={"target": recipe.target.model_copy(update={"generation": generation})}).to_yaml()


def _checkpoint(folder: Path, recipe_yaml: str | None = None) -> Path:
    """A training checkpoint's draft files (as tests/test_eval_cli.py writes one), with the run
    segment's recipe.yaml when given."""
    from safetensors.torch import save_file

    draft = tiny_eval_draft(tiny_target())
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in draft.state_dict().items()
             if k not in ("embed_tokens.weight", "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "draft_config.json").write_text(json.dumps(asdict(draft.config)))
    if recipe_yaml is not None:
        (folder / "recipe.yaml").write_text(recipe_yaml)
    return folder


def _export(folder: Path, recipe_yaml: str | None) -> Path:
    """An export whose model card holds ``recipe_yaml`` (as draftforge export writes it), or none."""
    return export_draft(tiny_eval_draft(tiny_target()), folder, card=ModelCard(recipe=recipe_yaml),
                        progress=lambda _: None)


def _eval(draft: Path, target_dir: Path, tmp_path: Path, *extra: str) -> int:
    from draftforge.cli import main

    return main(["eval", str(draft), "--target", str(target_dir), "--workloads", "gsm8k",
                 "--num-prompts", "1", "--max-new-tokens", "4", "--out", str(tmp_path / "r"), *extra])


@pytest.mark.parametrize("saved", ["recipe.yaml", "run config.yaml", "run directory"])
def test_a_checkpoint_trained_with_thinking_is_evaluated_with_thinking_without_recipe(
        recipe_path, target_dir, tmp_path, rendering_target, capsys, saved):
    """Its recipe.yaml (or, without one, its run's config.yaml; for a run directory, its newest
    complete checkpoint's) says enable_thinking true: the workloads are rendered so, and the
    line says where that came from."""
    text = _recipe_yaml(recipe_path, thinking=True)
    run = tmp_path / "run"
    if saved == "recipe.yaml":
        draft = _checkpoint(run / "checkpoints" / "step_00000008", text)
        record = draft / "recipe.yaml"
    elif saved == "run config.yaml":
        draft = _checkpoint(run / "checkpoints" / "step_00000008")
        record = run / "config.yaml"
        record.write_text(text)
    else:  # an older segment trained without thinking; the newest checkpoint is evaluated
        for step, recipe_yaml in ((4, _recipe_yaml(recipe_path, thinking=False)), (8, text)):
            ckpt = _checkpoint(run / "checkpoints" / f"step_{step:08d}", recipe_yaml)
            (ckpt / "COMPLETE").write_text("")
            (ckpt / "trainer_state.json").write_text("{}")
        draft, record = run, ckpt / "recipe.yaml"
    with pytest.raises(Rendered) as rendered:
        _eval(draft, target_dir, tmp_path)
    assert rendered.value.args[0]["enable_thinking"] is True
    assert rendered.value.args[0]["chat_template"] is None
    assert (f"eval: workload prompts rendered with thinking on and the target tokenizer's chat "
            f"template (as {record} records its training)") in capsys.readouterr().out


@pytest.mark.parametrize("thinking", [True, False])
def test_an_export_is_evaluated_with_the_thinking_mode_it_records_without_recipe(
        recipe_path, target_dir, tmp_path, rendering_target, capsys, thinking):
    """An export records its training recipe in its model card (README.md's Recipe section); one
    trained without thinking is evaluated as before, and says so."""
    export = _export(tmp_path / "export", _recipe_yaml(recipe_path, thinking=thinking))
    with pytest.raises(Rendered) as rendered:
        _eval(export, target_dir, tmp_path)
    assert rendered.value.args[0]["enable_thinking"] is thinking
    assert (f"eval: workload prompts rendered with thinking {'on' if thinking else 'off'} and the target "
            f"tokenizer's chat template (as {export / 'README.md'} (its Recipe section) records its "
            "training)") in capsys.readouterr().out


def test_a_draft_trained_with_its_own_chat_template_is_evaluated_with_it(
        recipe_path, target_dir, tmp_path, rendering_target, capsys):
    """The recorded template renders the workloads, whatever the tokenizer holds (here a dict of
    named templates, which round 60's comparison refused)."""
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    ckpt = _checkpoint(tmp_path / "ckpt", _recipe_yaml(recipe_path, thinking=False, template=template))
    with pytest.raises(Rendered) as rendered:
        _eval(ckpt, target_dir, tmp_path)
    assert rendered.value.args[0] == {"tokenize": False, "add_generation_prompt": True,
                                      "chat_template": template, "enable_thinking": False}
    assert (f"rendered with thinking off and a chat template of {len(template)} characters from "
            f"target.generation (as {ckpt / 'recipe.yaml'} records its training)") in capsys.readouterr().out


def test_the_rendering_used_is_recorded_in_the_report(recipe_path, target_dir, tmp_path, monkeypatch, capsys):
    """A whole evaluation, without --recipe, of a checkpoint recording thinking on: report.json
    says which rendering and which record. The target folder stands for the recipe's random
    target of the same shape, whose tokenizer renders the workloads."""
    from draftforge.splitserve import target as target_module

    build, random_target = target_module.build_target, load_recipe(recipe_path).target
    monkeypatch.setattr(target_module, "build_target",
                        lambda cfg, *args, **kwargs: build(random_target.model_copy(
                            update={"generation": cfg.generation, "dtype": cfg.dtype}), *args, **kwargs))
    ckpt = _checkpoint(tmp_path / "ckpt", _recipe_yaml(recipe_path, thinking=True))
    from draftforge.cli import main

    assert main(["eval", str(ckpt), "--target", str(target_dir), "--workloads", "gsm8k",
                 "--num-prompts", "1", "--max-new-tokens", "4", "--baselines", "none", "--no-estimate",
                 "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["prompt_rendering"] == {"training_recipe": str(ckpt / "recipe.yaml"), "enable_thinking": True,
                                          "chat_template": "tokenizer"}


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_a_draft_recording_no_recipe_keeps_the_default_and_says_which(target_dir, tmp_path, rendering_target,
                                                                       capsys, kind):
    """Another tool's export, or a checkpoint copied without its recipe: evaluated as before,
    with a line saying the thinking mode used and what to do if it was trained otherwise."""
    draft = _checkpoint(tmp_path / "ckpt") if kind == "checkpoint" else _export(tmp_path / "export", None)
    with pytest.raises(Rendered) as rendered:
        _eval(draft, target_dir, tmp_path)
    assert rendered.value.args[0]["enable_thinking"] is False
    assert rendered.value.args[0]["chat_template"] is None
    out = capsys.readouterr().out
    assert ("eval: workload prompts rendered with thinking off and the target tokenizer's chat template "
            "(the default without --recipe; the draft records no training recipe") in out
    assert "pass the recipe it was trained with as --recipe" in out


def test_with_recipe_its_generation_settings_are_used_as_given(recipe_path, target_dir, tmp_path, no_target, capsys):
    """--recipe: its target.generation renders the workloads, with a note where the draft's
    record says its training rendered them otherwise (the recipe is the user's choice)."""
    ckpt = _checkpoint(tmp_path / "ckpt", _recipe_yaml(recipe_path, thinking=True))
    with pytest.raises(TargetLoaded):
        _eval(ckpt, target_dir, tmp_path, "--recipe", str(recipe_path))
    out, err = capsys.readouterr()
    assert ("eval: workload prompts rendered with thinking off and the target tokenizer's chat template "
            "(the recipe's target.generation)") in out
    assert (f"eval: note: {ckpt} was trained with target.generation enable_thinking true where --recipe "
            f"has false (as {ckpt / 'recipe.yaml'} records): its acceptance length is measured on prompts "
            "rendered otherwise than its training's") in err


def test_with_the_training_recipe_there_is_no_note(recipe_path, target_dir, tmp_path, no_target, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt", _recipe_yaml(recipe_path, thinking=False))
    with pytest.raises(TargetLoaded):
        _eval(ckpt, target_dir, tmp_path, "--recipe", str(recipe_path))
    assert "note:" not in capsys.readouterr().err


def test_a_template_in_a_note_is_given_by_its_length():
    from draftforge.eval.training_record import _shown

    assert (_shown(True), _shown(False), _shown("{{ x }}"), _shown(None)) == (
        "true", "false", "a template of 7 characters", "none (the tokenizer's template)")


def test_token_id_prompts_are_not_rendered_so_not_checked(recipe_path, target_dir, tmp_path, no_target, capsys):
    ckpt = _checkpoint(tmp_path / "ckpt", _recipe_yaml(recipe_path, thinking=True))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"workload": "w", "input_ids": random_prompts(1)[0]}))
    from draftforge.cli import main

    with pytest.raises(TargetLoaded):
        main(["eval", str(ckpt), "--target", str(target_dir), "--prompts-file", str(prompts),
              "--max-new-tokens", "4", "--out", str(tmp_path / "r")])
    assert "workload prompts rendered" not in capsys.readouterr().out


def test_compare_says_when_two_reports_rendered_the_workloads_otherwise(tmp_path, capsys):
    """Two drafts evaluated without --recipe, each as its training recipe records: their prompts
    differ, and compare names the rendering as the likely cause."""
    from draftforge.cli import main

    def report(name: str, thinking: bool, digest: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        workload = {"num_prompts": 1, "prompt_digest": digest,
                    "methods": {"dspark": {"prompt_rounds": [2], "prompt_al_sum": [3.0]}}}
        (folder / "report.json").write_text(json.dumps({
            "workloads": {"gsm8k": workload},
            "prompt_rendering": {"training_recipe": "r.yaml", "enable_thinking": thinking,
                                 "chat_template": "tokenizer"}}))
        return folder / "report.json"

    assert main(["eval", "compare", str(report("a", False, "abc")), str(report("b", True, "xyz"))]) == 2
    assert ("were measured on different prompts (1 prompts, digest abc against 1, xyz); they rendered the "
            "workloads otherwise (enable_thinking False against True: without --recipe each draft is "
            "evaluated as its training recipe records; pass the same --recipe to both)") in capsys.readouterr().err


def _recording_target(recipe_path: Path, model: str, **target) -> str:
    """A saved training recipe whose target is ``model`` (with ``target`` settings)."""
    recipe = load_recipe(recipe_path)
    return recipe.model_copy(update={"target": recipe.target.model_copy(update={"model": model, **target})}).to_yaml()


def test_without_target_the_recorded_target_is_evaluated(recipe_path, target_dir, tmp_path, monkeypatch, capsys):
    """`draftforge eval DRAFT` alone: the target the draft's training recipe names (review round 61)."""
    from draftforge.cli import main

    built = []

    def stop(cfg, *args, **kwargs):
        built.append(cfg)
        raise TargetLoaded

    monkeypatch.setattr("draftforge.splitserve.target.build_target", stop)
    ckpt = _checkpoint(tmp_path / "ckpt", _recording_target(recipe_path, str(target_dir)))
    with pytest.raises(TargetLoaded):
        main(["eval", str(ckpt), "--workloads", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "4",
              "--out", str(tmp_path / "r"), "--dtype", "bfloat16"])
    assert [(cfg.model, cfg.dtype) for cfg in built] == [(str(target_dir), "bfloat16")]
    assert (f"eval: target {str(target_dir)!r}, as {ckpt / 'recipe.yaml'} records its training (--target "
            "chooses another)") in capsys.readouterr().out
    # a relative path that exists where eval runs is taken, and said to be
    relative = _checkpoint(tmp_path / "relative", _recording_target(recipe_path, target_dir.name))
    monkeypatch.chdir(target_dir.parent)
    with pytest.raises(TargetLoaded):
        main(["eval", str(relative), "--workloads", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "4",
              "--out", str(tmp_path / "r2")])
    assert built[-1].model == target_dir.name
    assert (f"eval: target {target_dir.name!r} (a relative path, found here as {target_dir.resolve()}), as "
            f"{relative / 'recipe.yaml'} records its training") in capsys.readouterr().out


@pytest.mark.parametrize(("model", "target", "named"), [
    ("random", {}, "records the random target, which is built from its recipe's target.shape: pass that "
                   "recipe as --recipe"),
    ("models/target", {}, "records target 'models/target', a path relative to where the training ran, which is "
                          "neither a registered name (smollm2-135m-instruct) nor a folder here: give this "
                          "machine's copy as --target"),
    ("/elsewhere/target", {}, "records target '/elsewhere/target', which is neither a registered name"),
    ("TARGET", {"trust_remote_code": True}, "with target.trust_remote_code true, which eval turns on only "
                                            "from a recipe: pass that recipe as --recipe"),
])
def test_without_target_a_recorded_target_that_needs_its_recipe_is_refused(
        recipe_path, target_dir, tmp_path, no_target, capsys, model, target, named):
    from draftforge.cli import main

    model = str(target_dir) if model == "TARGET" else model
    ckpt = _checkpoint(tmp_path / "ckpt", _recording_target(recipe_path, model, **target))
    assert main(["eval", str(ckpt), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"give --target NAME_OR_DIR (or --recipe RECIPE): {ckpt / 'recipe.yaml'} records" in err
    assert named in err


@pytest.mark.parametrize(("recipe_yaml", "named"), [
    ("target:\n  model: 123\n", "{path} records target.model 123 (int), which is neither a name nor a folder"),
    ("target:\n  model: [a, b]\n", "{path} records target.model ['a', 'b'] (list), which is neither a name "
                                    "nor a folder"),
    ("- target\n- draft\n", "the draft's training recipe {path} is not a YAML mapping of sections"),
    ("target: smollm2\n", "the draft's training recipe {path} has a target that is not a section of keys"),
    ("draft:\n  block_size: 4\n", "the draft's training recipe {path} has no target section"),
])
def test_without_target_a_hand_edited_record_is_refused_for_what_it_is(tmp_path, no_target, capsys,
                                                                       recipe_yaml, named):
    """A record whose target.model is not a string was reported as naming none, and a record
    that is not a mapping was blamed on its target.generation (review round 62)."""
    from draftforge.cli import main

    ckpt = _checkpoint(tmp_path / "ckpt", recipe_yaml)
    assert main(["eval", str(ckpt), "--out", str(tmp_path / "r")]) == 2
    expected = "give --target NAME_OR_DIR (or --recipe RECIPE): " + named.format(path=ckpt / "recipe.yaml")
    assert expected in capsys.readouterr().err


def test_eval_reads_the_training_record_once(recipe_path, target_dir, tmp_path, monkeypatch, no_target):
    """Without --target, the record names the target and renders the prompts: one reading for
    both, so the two cannot disagree about a file changed between them (review round 62)."""
    import draftforge.eval.training_record as training_record_module
    from draftforge.cli import main

    reads = []
    original = training_record_module.training_record

    def counting(draft):
        reads.append(draft)
        return original(draft)

    monkeypatch.setattr(training_record_module, "training_record", counting)
    ckpt = _checkpoint(tmp_path / "ckpt", _recording_target(recipe_path, str(target_dir)))
    with pytest.raises(TargetLoaded):
        main(["eval", str(ckpt), "--workloads", "gsm8k", "--num-prompts", "1", "--max-new-tokens", "4",
              "--out", str(tmp_path / "r")])
    assert reads == [str(ckpt)]
