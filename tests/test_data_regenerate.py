"""Regeneration: turn-by-turn answers, resume after interruption, crash safety.

A fake engine answers deterministically from the conversation *and* the call's
seed, like a real sampler; since the seed comes from the batch, an answer
changes if a resumed run batched prompts differently from an uninterrupted one,
so the "same file" tests would catch that.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from regenerate_helpers import (
    SETTINGS,
    FakeEngine,
    Interrupted,
    build_broken_engine,
    build_dying_engine,
    build_engine_named_for_its_bars,
    build_failing_engine,
    build_fake_engine,
    make_prompts,
)

from draftforge.data.formats import Conversation
from draftforge.data.regenerate import (
    RegenerationError,
    batch_seed,
    check_answers,
    regenerate,
)
from draftforge.splitserve.config import GenerationConfig


def run(tmp_path: Path, name: str, engine=None, prompts=None, settings=SETTINGS):
    out = tmp_path / name
    report = regenerate(
        prompts or make_prompts(), engine or FakeEngine(), settings, out, progress=False
    )
    return out, report


def test_rows_turn_by_turn_with_system_prompt(tmp_path):
    engine = FakeEngine()
    out, report = run(tmp_path, "r.jsonl", engine)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i:02d}" for i in range(11)]
    assert report.num_generated == 11 and report.num_reused == 0
    row = rows[0]  # system prompt + two user turns
    assert set(row) == {"id", "messages", "unfinished_turns", "generation", "target"}
    assert row["unfinished_turns"] == []  # the fake engine returns plain strings: finished
    assert row["target"] == "fake-target"
    assert row["generation"] == SETTINGS.model_dump(mode="json")
    assert [m["role"] for m in row["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert row["messages"][0]["content"] == "system 0"
    # The second turn was answered given the regenerated first reply.
    asked = [conv for convs, _ in engine.calls for conv in convs]
    second_turn = [conv for conv in asked if conv[-1]["content"] == "follow-up 0"]
    assert second_turn == [row["messages"][:4]]
    # One call per batch of 3 and turn; the seed depends on the batch ids and turn.
    assert engine.calls[0][1] == batch_seed(5, ["p00", "p01", "p02"], 0)
    assert all(len(c) <= 3 for c, _ in engine.calls)
    assert not (tmp_path / "r.jsonl.partial").exists()


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, capsys):
    reference, _ = run(tmp_path, "ref.jsonl")
    # Fail on the 4th generate call (batch 2's second turn): batch 1 is on disk.
    with pytest.raises(Interrupted):
        run(tmp_path, "out.jsonl", FakeEngine(fail_on_call=4))
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    assert not out.exists() and partial.exists()
    assert len(partial.read_text().splitlines()) == 3
    engine = FakeEngine()
    _, report = run(tmp_path, "out.jsonl", engine)
    assert report.num_reused == 3 and report.num_generated == 8
    assert f"continuing; 3 of 11 prompts already answered in {partial}" in capsys.readouterr().err
    asked = [conv[-1]["content"] for convs, _ in engine.calls for conv in convs]
    assert "question 0" not in asked and "question 3" in asked
    assert out.read_bytes() == reference.read_bytes()
    assert not partial.exists()


def test_a_run_stopped_between_writing_the_file_and_removing_its_partial_resumes(tmp_path):
    """The last step writes the finished file, then removes the .partial it came from; a
    crash in between leaves both, holding the same rows. A rerun finishes the cleanup; two
    files with different rows are still refused."""
    reference, _ = run(tmp_path, "out.jsonl")
    partial = tmp_path / "out.jsonl.partial"
    lines = reference.read_bytes().splitlines(keepends=True)
    partial.write_bytes(b"".join(reversed(lines)))  # the same rows, in the order answered
    engine = FakeEngine()
    out, report = run(tmp_path, "out.jsonl", engine)
    assert not partial.exists() and out.read_bytes() == b"".join(lines)
    assert report.num_generated == 0 and engine.calls == []
    partial.write_bytes(b"".join(lines[:4]))
    with pytest.raises(RegenerationError, match=r"both .*out.jsonl and .*out.jsonl.partial exist"):
        run(tmp_path, "out.jsonl")
    assert partial.read_bytes() == b"".join(lines[:4])


def test_torn_last_line_is_repaired_and_result_identical(tmp_path):
    reference, _ = run(tmp_path, "ref.jsonl")
    lines = reference.read_bytes().splitlines(keepends=True)
    # A crash cut the write of batch 2 (rows 4-6) in the middle of row 5.
    partial = tmp_path / "out.jsonl.partial"
    partial.write_bytes(b"".join(lines[:4]) + lines[4][:25])
    engine = FakeEngine()
    out, report = run(tmp_path, "out.jsonl", engine)
    assert report.num_reused == 3  # row 4 belonged to the torn batch: regenerated with it
    assert out.read_bytes() == reference.read_bytes()


def test_torn_line_at_batch_start_keeps_previous_batch_result(tmp_path):
    reference, _ = run(tmp_path, "ref.jsonl")
    lines = reference.read_bytes().splitlines(keepends=True)
    partial = tmp_path / "out.jsonl.partial"
    partial.write_bytes(b"".join(lines[:6]) + lines[6][:10])
    out, _ = run(tmp_path, "out.jsonl")
    assert out.read_bytes() == reference.read_bytes()


def test_write_cut_at_a_line_boundary_regenerates_the_whole_batch(tmp_path):
    """No torn line to notice: batch 2 has only its first row on disk. Kept, its other
    rows would be generated as a smaller batch with another seed."""
    reference, _ = run(tmp_path, "ref.jsonl")
    lines = reference.read_bytes().splitlines(keepends=True)
    (tmp_path / "out.jsonl.partial").write_bytes(b"".join(lines[:4]))
    out, report = run(tmp_path, "out.jsonl")
    assert report.num_reused == 3 and report.num_generated == 8
    assert out.read_bytes() == reference.read_bytes()


def test_more_prompts_regenerate_a_short_last_batch_whole(tmp_path):
    """5 prompts in batches of 3 end with a batch of 2; with 11 prompts those two belong
    to a batch of 3, so they are answered again with it, as an 11-prompt run would."""
    reference, _ = run(tmp_path, "ref.jsonl")
    run(tmp_path, "r.jsonl", prompts=make_prompts(5))
    out, report = run(tmp_path, "r.jsonl")
    assert report.num_reused == 3 and report.num_generated == 8
    assert out.read_bytes() == reference.read_bytes()


def test_rerun_of_finished_file_generates_nothing(tmp_path):
    out, _ = run(tmp_path, "r.jsonl")
    before = out.read_bytes()
    engine = FakeEngine()
    _, report = run(tmp_path, "r.jsonl", engine)
    assert engine.calls == [] and report.num_reused == 11 and report.num_generated == 0
    assert out.read_bytes() == before


def test_more_prompts_later_continue_from_the_finished_file(tmp_path):
    out, _ = run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    first = out.read_text().splitlines()
    _, report = run(tmp_path, "r.jsonl", prompts=make_prompts(11))
    lines = out.read_text().splitlines()
    assert report.num_reused == 6 and report.num_generated == 5
    assert lines[:6] == first and len(lines) == 11


def test_changed_settings_refuse_to_mix(tmp_path):
    run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    other = GenerationConfig(batch_size=3, temperature=0.0, seed=5)
    # the message names the one setting that differs, not the whole section
    with pytest.raises(
        RegenerationError,
        match=r"other target.generation settings \(temperature: file 0.7, this run 0.0\)",
    ):
        run(tmp_path, "r.jsonl", prompts=make_prompts(11), settings=other)


def test_changed_target_refuses_to_mix(tmp_path):
    run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    other = FakeEngine()
    other.name = "another-target"
    with pytest.raises(
        RegenerationError,
        match="holds answers of target 'fake-target', but this run's target is 'another-target'",
    ):
        run(tmp_path, "r.jsonl", other, prompts=make_prompts(11))


def test_foreign_ids_refused_unless_every_prompt_is_answered(tmp_path, capsys):
    out, _ = run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    before = out.read_bytes()
    # a larger run's finished file answers a smaller run's prompts: nothing to do
    _, report = run(tmp_path, "r.jsonl", prompts=make_prompts(4))
    assert report.num_reused == 4 and report.num_generated == 0
    assert "also answers 2 other prompts" in capsys.readouterr().err
    # a prompt it lacks: it cannot be extended, since it holds other prompts' rows
    prompts = [*make_prompts(4), Conversation("p10", [{"role": "user", "content": "new"}])]
    with pytest.raises(
        RegenerationError, match="holds id 'p04', which is not among this run's prompts"
    ):
        run(tmp_path, "r.jsonl", prompts=prompts)
    assert out.read_bytes() == before


def test_changed_prompt_text_under_the_same_id_refused(tmp_path):
    # A newer prompt set keeps the ids (train-00001, ...) but not the texts: resuming must
    # not mix answers to the old prompts into the new run, finished file or partial.
    out, _ = run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    changed = make_prompts(11)
    changed[4] = Conversation("p04", [{"role": "system", "content": "system 4"},
                                      {"role": "user", "content": "another question"}])
    with pytest.raises(RegenerationError, match="id 'p04'. answers a different prompt"):
        run(tmp_path, "r.jsonl", prompts=changed)
    os.replace(out, tmp_path / "r.jsonl.partial")
    with pytest.raises(RegenerationError, match="id 'p04'. answers a different prompt"):
        run(tmp_path, "r.jsonl", prompts=changed)
    _, report = run(tmp_path, "r.jsonl", prompts=make_prompts(11))  # unchanged: continues
    assert report.num_reused == 6 and report.num_generated == 5


def test_engine_returning_wrong_count_is_an_error(tmp_path):
    class Bad(FakeEngine):
        def generate(self, conversations, settings):
            return super().generate(conversations, settings)[:-1]

    with pytest.raises(RuntimeError, match="returned 2 replies for 3 conversations"):
        run(tmp_path, "r.jsonl", Bad())


def test_check_answers_accepts_this_runs_file_and_a_larger_one(tmp_path):
    out, _ = run(tmp_path, "r.jsonl", prompts=make_prompts(11))
    written = out.read_bytes()
    assert check_answers(out, make_prompts(11), SETTINGS, "fake-target") is None
    assert check_answers(out, make_prompts(6), SETTINGS, "fake-target") is None  # rows of other ids ignored
    assert out.read_bytes() == written  # checked only: the file is left as it was


def test_check_answers_refuses_a_stale_file(tmp_path):
    out, _ = run(tmp_path, "r.jsonl", prompts=make_prompts(6))
    changed = make_prompts(6)
    changed[2] = Conversation("p02", [{"role": "user", "content": "another question"}])
    cases = [
        (changed, SETTINGS, "fake-target", "id 'p02'. answers a different prompt"),
        (make_prompts(6), SETTINGS, "other", "target 'fake-target', but this run's target is 'other'"),
        (make_prompts(6), GenerationConfig(batch_size=3, temperature=0.7, seed=5, top_k=40),
         "fake-target", r"settings \(top_k: file 20, this run 40\)"),
        (make_prompts(8), SETTINGS, "fake-target", "answers 6 of this run's 8 prompts"),
    ]  # fmt: skip
    for prompts, settings, target, message in cases:
        with pytest.raises(RegenerationError, match=message):
            check_answers(out, prompts, settings, target)
    with open(out, "ab") as handle:
        handle.write(b'{"id": "p0')  # a cut write
    with pytest.raises(RegenerationError, match="ends with an incomplete line"):
        check_answers(out, make_prompts(6), SETTINGS, "fake-target")


def _tiny_answers(tmp_path, overrides=()):
    """tiny-debug's first 8 built-in prompts answered by a fake engine named like its target."""
    from draftforge.config import load_recipe
    from draftforge.data.loading import load_prompts

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    cfg = load_recipe(recipe, [f"train.output_dir={tmp_path}", "data.num_samples=8", *overrides])
    engine = FakeEngine()
    engine.name = "random"
    prompts = load_prompts(cfg.data).conversations
    regenerate(prompts, engine, cfg.target.generation, tmp_path / "regenerated.jsonl",
               progress=False)  # fmt: skip
    return recipe, prompts


def test_training_refuses_answers_that_are_not_the_recipes(tmp_path):
    from draftforge.config import load_recipe
    from draftforge.errors import InputError
    from draftforge.splitserve.launch import preflight
    from draftforge.splitserve.producer import load_source_conversations

    recipe, prompts = _tiny_answers(tmp_path)
    base = [f"train.output_dir={tmp_path}"]
    conversations, regenerate_now = load_source_conversations(load_recipe(recipe, [*base, "data.num_samples=8"]))
    assert not regenerate_now and [c.id for c in conversations] == [p.id for p in prompts]
    assert conversations[0].messages[-1]["content"].startswith("reply ")  # the file's answers
    # fewer prompts than the file answers: its first rows, as they are
    fewer, _ = load_source_conversations(load_recipe(recipe, [*base, "data.num_samples=5"]))
    assert [c.id for c in fewer] == [p.id for p in prompts[:5]]
    # other sampling settings, or more prompts than it answers: refused, before torchrun too
    for extra, message in ((["data.num_samples=8", "target.generation.temperature=0.1"],
                            "temperature: file 0.7, this run 0.1"),
                           (["data.num_samples=10"], "answers 8 of this run's 10 prompts")):  # fmt: skip
        cfg = load_recipe(recipe, [*base, *extra])
        with pytest.raises(RegenerationError, match=message):
            load_source_conversations(cfg)
        with pytest.raises(InputError, match=message):
            preflight(cfg)
    # every prompt answered, and other prompts too (a file written for more prompts, which
    # 'data regenerate' accepts as answering these): training takes this run's, in order
    path = tmp_path / "regenerated.jsonl"
    lines = path.read_text().splitlines()
    foreign = json.loads(lines[0]) | {"id": "elsewhere-1"}
    path.write_text("\n".join([json.dumps(foreign), *lines[::-1]]) + "\n")
    for count in ("data.num_samples=8", "data.num_samples=5"):
        taken, _ = load_source_conversations(load_recipe(recipe, [*base, count]))
        assert [c.id for c in taken] == [p.id for p in prompts[: int(count.split("=")[1])]]
        assert taken[0].messages[-1]["content"].startswith("reply ")


def test_cli_main_writes_default_path(tmp_path, monkeypatch):
    import draftforge.splitserve.target as target_module
    from draftforge.data import regenerate as regen_module

    built = {}

    def fake_build_target(cfg, layer_ids, *, device, tensor_parallel):
        built["model"], built["threads"] = cfg.model, cfg.num_threads
        built["device"], built["tp"] = device, tensor_parallel
        return FakeEngine()

    monkeypatch.setattr(target_module, "build_target", fake_build_target)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    status = regen_module.main(
        [str(recipe), f"train.output_dir={tmp_path}", "data.num_samples=7", "--no-progress"]
    )
    assert status == 0 and built["model"] == "random"
    rows = [json.loads(line) for line in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"train-{i:05d}" for i in range(1, 8)]
    assert rows[0]["generation"]["max_new_tokens"] == 32  # the recipe's settings
    from draftforge.config import load_recipe

    dtype = load_recipe(recipe).target.dtype  # 'auto' resolved for this CPU
    assert dtype in ("float32", "bfloat16")
    assert rows[0]["arithmetic"] == {"device": "cpu", "backend": "hf", "dtype": dtype,
                                     "threads": len(os.sched_getaffinity(0))}
    # alone on the machine, the target uses every core it may run on, or --threads
    assert built["threads"] == len(os.sched_getaffinity(0))
    # overrides after an option are taken too, as train takes them
    assert regen_module.main([str(recipe), f"train.output_dir={tmp_path}", "--no-progress",
                              "data.num_samples=7", "--threads", "3"]) == 0
    assert built["threads"] == 3
    assert (built["device"], built["tp"]) == ("cpu", 1)  # no GPU here: auto is the CPU
    with pytest.raises(SystemExit):
        regen_module.main([str(recipe), "--threads", "0"])


def test_an_auto_target_dtype_follows_the_device_the_target_is_put_on(tmp_path, monkeypatch):
    """On a CUDA machine 'auto' resolves to bfloat16 for the GPU; a target put on a CPU without
    native bf16 (--device cpu) must run float32 there, not bfloat16 emulated at 1/70 speed."""
    import torch

    import draftforge.precision as precision
    import draftforge.splitserve.target as target_module
    from draftforge.config import load_recipe
    from draftforge.data import regenerate as regen_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda *a, **k: [])
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    target = load_recipe(recipe, ["target.dtype=auto"]).target
    assert target.dtype == "bfloat16" and target.dtype_on("cuda:0") == "bfloat16"
    assert target.dtype_on("cpu") == "float32"
    built = {}

    def fake_build_target(cfg, layer_ids, *, device, tensor_parallel):
        built["dtype"], built["device"] = cfg.dtype, device
        return FakeEngine()

    monkeypatch.setattr(target_module, "build_target", fake_build_target)
    assert regen_module.main([str(recipe), f"train.output_dir={tmp_path}", "data.num_samples=3",
                              "target.dtype=auto", "--no-progress", "--device", "cpu", "--workers", "1"]) == 0
    assert built == {"dtype": "float32", "device": "cpu"}
    row = json.loads((tmp_path / "regenerated.jsonl").read_text().splitlines()[0])
    assert row["arithmetic"]["dtype"] == "float32"


def test_regeneration_runs_where_the_recipe_puts_its_target():
    """--device auto: the recipe's first target GPU when CUDA is visible, and an SGLang target
    keeps its tensor-parallel group there; on CPU, or with the hf backend, one rank."""
    from draftforge.config import load_recipe
    from draftforge.data.regenerate import RegenerationError, target_placement

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    ling = load_recipe(recipes / "ling3-flash-dspark.yaml")  # sglang, tp 4, target GPUs 0-3
    assert target_placement("auto", ling, cuda_available=True) == ("cuda:0", 4)
    assert target_placement("auto", ling, cuda_available=False) == ("cpu", 1)
    assert target_placement("cuda:4", ling, cuda_available=True) == ("cuda:4", 4)
    moved = load_recipe(recipes / "ling3-flash-dspark.yaml", ["split.target_devices=[4,5,6,7]",
                                                             "split.trainer_devices=[0,1,2,3]"])
    assert target_placement("auto", moved, cuda_available=True) == ("cuda:4", 4)
    tiny = load_recipe(recipes / "tiny-debug.yaml")  # hf backend
    assert target_placement("auto", tiny, cuda_available=True) == ("cuda:0", 1)
    with pytest.raises(RegenerationError, match="no CUDA GPU is visible"):
        target_placement("cuda", tiny, cuda_available=False)
    with pytest.raises(RegenerationError, match="'tpu' is not a device"):
        target_placement("tpu", tiny, cuda_available=True)
    with pytest.raises(RegenerationError, match="runs on cpu or cuda"):
        target_placement("meta", tiny, cuda_available=True)


def test_cli_main_reports_data_errors(tmp_path, capsys):
    from draftforge.data import regenerate as regen_module

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    missing = tmp_path / "none.jsonl"
    status = regen_module.main([str(recipe), f"data.train_files=['{missing}']"])
    assert status == 2
    assert f"data file not found: {missing}" in capsys.readouterr().err
    # an empty data file, and an output path that is a folder or cannot be made
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    status = regen_module.main([str(recipe), f"data.train_files=['{empty}']"])
    err = capsys.readouterr().err
    assert status == 2 and f"data.train_files ['{empty}'] hold no prompts; nothing to answer" in err, err
    data = tmp_path / "one.jsonl"
    data.write_text('{"id": "a", "prompt": "hello"}\n')
    status = regen_module.main([str(recipe), f"data.train_files=['{data}']",
                                f"data.regenerated_file={tmp_path}"])
    assert status == 2 and f"data.regenerated_file {tmp_path} is a folder" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("")
    status = regen_module.main([str(recipe), f"data.train_files=['{data}']",
                                f"data.regenerated_file={blocked}/sub/out.jsonl"])
    assert status == 2 and "its folder cannot be made" in capsys.readouterr().err
    # a device that cannot be used is refused before the output's folder is made
    out = tmp_path / "made" / "answers.jsonl"
    status = regen_module.main([str(recipe), f"data.train_files=['{data}']", "--device", "tpu",
                                f"data.regenerated_file={out}"])
    err = capsys.readouterr().err
    assert status == 2 and "'tpu' is not a device" in err and "prompts ->" not in err, err
    assert not out.parent.exists()


@pytest.mark.integration
def test_smollm2_interrupted_resume_equals_uninterrupted(tmp_path):
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target

    class Interrupting:
        def __init__(self, engine, fail_on_call):
            self.engine, self.name, self.fail_on_call, self.num_calls = (
                engine,
                engine.name,
                fail_on_call,
                0,
            )

        def generate(self, conversations, settings):
            self.num_calls += 1
            if self.num_calls == self.fail_on_call:
                raise Interrupted
            return self.engine.generate(conversations, settings)

    engine = build_target(TargetConfig(model="smollm2-135m-instruct", dtype="float32"), [1])
    settings = GenerationConfig(batch_size=2, max_new_tokens=12, temperature=0.7, seed=1)
    prompts = [
        Conversation("a", [{"role": "user", "content": "Name a fruit."}]),
        Conversation(
            "b",
            [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is 3 + 4?"},
                {"role": "user", "content": "And times 2?"},
            ],
        ),
        Conversation("c", [{"role": "user", "content": "Say hello in French."}]),
    ]
    reference = tmp_path / "ref.jsonl"
    regenerate(prompts, engine, settings, reference, progress=False)
    out = tmp_path / "out.jsonl"
    with pytest.raises(Interrupted):
        regenerate(prompts, Interrupting(engine, 3), settings, out, progress=False)
    regenerate(prompts, engine, settings, out, progress=False)
    assert out.read_bytes() == reference.read_bytes()
    rows = [json.loads(line) for line in reference.read_text().splitlines()]
    assert rows[1]["target"] == "smollm2-135m-instruct"
    assert [m["role"] for m in rows[1]["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert all(m["content"].strip() for m in rows[1]["messages"])


def test_regenerated_file_loads_as_training_conversations(tmp_path):
    from draftforge.data.config import DataConfig
    from draftforge.data.loading import load_training_conversations

    out, _ = run(tmp_path, "regenerated.jsonl")
    result = load_training_conversations(DataConfig(overlap_check=False), tmp_path)
    convs = result.conversations
    assert [c.id for c in convs] == [f"p{i:02d}" for i in range(11)]
    assert convs[0].messages[-1]["role"] == "assistant"
    assert convs[0].extra["target"] == "fake-target"


def test_replies_cut_at_the_limit_are_recorded(tmp_path):
    from draftforge.data.regenerate import answer_batch
    from draftforge.splitserve.target import Reply

    class CuttingEngine(FakeEngine):
        def generate(self, conversations, settings):
            texts = super().generate(conversations, settings)
            # The first conversation's replies never finish.
            return [Reply(t, finished=i != 0) for i, t in enumerate(texts)]

    prompts = make_prompts(3)
    histories, unfinished, token_ids = answer_batch(prompts, CuttingEngine(), GenerationConfig())
    assert [len(ids) for ids in token_ids] == [len(h) for h in histories]
    assert all(ids is None for row in token_ids for ids in row)  # the engine reports none
    assert unfinished[1:] == [[], []]
    assistant_positions = [i for i, m in enumerate(histories[0]) if m["role"] == "assistant"]
    assert unfinished[0] == assistant_positions and assistant_positions
    assert all(type(m["content"]) is str for h in histories for m in h)


def test_rows_are_read_line_by_line_with_every_kind_of_cut(tmp_path):
    from draftforge.data.regenerate import _read_rows

    rows = [{"id": f"p{i}", "n": i, "messages": []} for i in range(4)]
    whole = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    path = tmp_path / "rows.jsonl"
    path.write_bytes(whole)
    assert _read_rows(path) == (rows, False)
    assert _read_rows(path, keep=lambda r, line: r["n"] % 2 == 1 and line == r["n"] + 1) == (
        [rows[1], rows[3]], False)
    path.write_bytes(whole + b'{"id": "p4')  # a write cut before its newline
    assert _read_rows(path) == (rows, True)
    path.write_bytes(whole + b'{"id": "p4\n')  # cut where the bytes happen to end in "\n"
    assert _read_rows(path) == (rows, True)
    path.write_bytes(whole + b"not json\n" + whole)  # damage in the middle is not a cut
    with pytest.raises(RegenerationError, match=r"rows.jsonl, line 5: not a regenerated row"):
        _read_rows(path)
    path.write_bytes(whole + b'["p5"]\n' + whole)
    with pytest.raises(RegenerationError, match="line 5: .*not a row object"):
        _read_rows(path)
    path.write_bytes(whole + b'{"id": "p5", "prompt": "Hi"}\n')  # whole JSON, last or not: no cut
    with pytest.raises(RegenerationError, match="line 5: .*no 'messages' list"):
        _read_rows(path)


# --- several workers (data/answer_workers.py) ---------------------------------------------
# Their engine builders are in regenerate_helpers.py, importable in spawned workers.
def test_several_workers_write_the_same_file_as_one(tmp_path):
    from draftforge.data.answer_workers import WorkerPool

    reference, _ = run(tmp_path, "one.jsonl")
    pooled, report = run(tmp_path, "pool.jsonl", engine=WorkerPool(build_fake_engine, 3, "fake-target"))
    assert pooled.read_bytes() == reference.read_bytes()
    assert (report.num_generated, report.num_reused) == (11, 0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (build_broken_engine, r"worker \d failed while building its target: ValueError: weights not "
                              r"found at /nowhere"),
        (build_failing_engine, r"worker \d failed while answering batch 2: RuntimeError: no answer "
                               r"for question 7"),
        (build_dying_engine, r"worker \d exited with status 9 without a message"),
    ],
)
def test_a_failing_worker_stops_the_run_and_a_rerun_finishes_it_identically(tmp_path, build, message):
    from draftforge.data.answer_workers import WorkerError, WorkerPool

    reference, _ = run(tmp_path, "one.jsonl")
    out = tmp_path / "pool.jsonl"
    with pytest.raises(WorkerError, match=message):
        regenerate(make_prompts(), WorkerPool(build, 2, "fake-target"), SETTINGS, out,
                   progress=False)
    assert not out.exists()
    kept = Path(str(out) + ".partial")
    assert kept.exists()  # batches finished before the failure stay
    report = regenerate(make_prompts(), WorkerPool(build_fake_engine, 2, "fake-target"), SETTINGS,
                        out, progress=False)
    assert out.read_bytes() == reference.read_bytes()
    assert report.num_reused + report.num_generated == 11


def test_a_worker_whose_target_has_another_name_is_refused(tmp_path):
    from draftforge.data.answer_workers import WorkerError, WorkerPool

    with pytest.raises(WorkerError, match="built target 'fake-target', expected 'other'"):
        regenerate(make_prompts(), WorkerPool(build_fake_engine, 2, "other"), SETTINGS,
                   tmp_path / "x.jsonl", progress=False)


BF16_ON_2 = {"device": "cpu", "backend": "hf", "dtype": "bfloat16", "threads": 2}


def test_arithmetic_record_and_which_differences_matter():
    from draftforge.data.regenerate import arithmetic_differences, arithmetic_record

    assert arithmetic_record(device="cpu", backend="hf", dtype="bfloat16", threads=2) == BF16_ON_2
    assert arithmetic_record(device="cuda:3", backend="sglang", dtype="bfloat16", threads=16,
                             tensor_parallel=4) == {"device": "cuda", "backend": "sglang",
                                                    "dtype": "bfloat16", "tensor_parallel": 4}
    one = dict(BF16_ON_2, threads=1)
    assert arithmetic_differences(BF16_ON_2, one) == "threads: file 2, this run 1"
    assert arithmetic_differences(BF16_ON_2, dict(BF16_ON_2)) is None
    f32 = dict(BF16_ON_2, dtype="float32")
    assert arithmetic_differences(f32, dict(f32, threads=1)) is None  # float32: threads do not matter
    assert arithmetic_differences(f32, dict(f32, threads=1, backend="sglang")) == (
        "backend: file 'hf', this run 'sglang'")
    assert arithmetic_differences(f32, one) == "dtype: file 'float32', this run 'bfloat16'; threads: file 2, this run 1"
    assert arithmetic_differences(None, one) is None  # a file from before the record
    assert arithmetic_differences(BF16_ON_2, None) is None  # a run without one


def test_resuming_with_other_arithmetic_is_refused_and_the_same_finishes_identically(tmp_path):
    prompts = make_prompts()
    reference = tmp_path / "ref.jsonl"
    regenerate(prompts, FakeEngine(), SETTINGS, reference, progress=False, arithmetic=BF16_ON_2)
    assert all(json.loads(line)["arithmetic"] == BF16_ON_2
               for line in reference.read_text().splitlines())
    out = tmp_path / "out.jsonl"
    with pytest.raises(Interrupted):
        regenerate(prompts, FakeEngine(fail_on_call=4), SETTINGS, out, progress=False,
                   arithmetic=BF16_ON_2)
    partial = tmp_path / "out.jsonl.partial"
    kept = partial.read_bytes()
    with pytest.raises(RegenerationError, match=(
            r"out.jsonl.partial \(id 'p00'\) was answered with other arithmetic "
            r"\(threads: file 2, this run 1\).*rerun with --threads 2")):
        regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False,
                   arithmetic=dict(BF16_ON_2, threads=1))
    assert partial.read_bytes() == kept and not out.exists()  # nothing touched
    # another dtype too: --threads alone cannot fix it, so it is not suggested
    with pytest.raises(RegenerationError) as err:
        regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False,
                   arithmetic=dict(BF16_ON_2, threads=1, dtype="float32"))
    assert "dtype: file 'bfloat16'" in str(err.value) and "--threads" not in str(err.value)
    regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False, arithmetic=BF16_ON_2)
    assert out.read_bytes() == reference.read_bytes()
    # A finished file extended to more prompts is continued too: the same check.
    with pytest.raises(RegenerationError, match=r"out.jsonl \(id 'p00'\) .*dtype: file 'bfloat16'"):
        regenerate(make_prompts(14), FakeEngine(), SETTINGS, out, progress=False,
                   arithmetic=dict(BF16_ON_2, dtype="float32"))
    assert out.read_bytes() == reference.read_bytes()


def test_a_file_from_before_the_arithmetic_record_is_continued(tmp_path):
    prompts = make_prompts()
    with pytest.raises(Interrupted):
        run(tmp_path, "out.jsonl", FakeEngine(fail_on_call=4))  # rows without the record
    out = tmp_path / "out.jsonl"
    regenerate(prompts, FakeEngine(), SETTINGS, out, progress=False, arithmetic=BF16_ON_2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert ["arithmetic" in r for r in rows] == [False] * 3 + [True] * 8


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_workers_load_without_progress_bars(tmp_path, quiet):
    """--no-progress reaches the spawned workers: transformers' loading bars are off there
    (the engine names itself after what it finds), and only then."""
    from draftforge.data.answer_workers import WorkerError, WorkerPool

    pool = WorkerPool(build_engine_named_for_its_bars, 2, "bars-off", quiet=quiet)
    if quiet:
        regenerate(make_prompts(4), pool, SETTINGS, tmp_path / "q.jsonl", progress=False)
    else:
        with pytest.raises(WorkerError, match="built target 'bars-on', expected 'bars-off'"):
            regenerate(make_prompts(4), pool, SETTINGS, tmp_path / "q.jsonl", progress=False)


def test_worker_plan():
    from draftforge.data.regenerate import worker_plan

    cpu = dict(device="cpu", backend="hf")
    assert worker_plan(None, None, cores=2, num_batches=40, **cpu) == (2, 1)
    assert worker_plan(None, None, cores=8, num_batches=3, **cpu) == (3, 2)  # one per batch
    assert worker_plan(1, None, cores=4, num_batches=40, **cpu) == (1, 4)
    assert worker_plan(2, 3, cores=4, num_batches=40, **cpu) == (2, 3)
    assert worker_plan(None, None, device="cuda:0", backend="hf", cores=16, num_batches=9) == (1, 16)
    assert worker_plan(None, 2, device="cpu", backend="sglang", cores=16, num_batches=9) == (1, 2)
    with pytest.raises(RegenerationError, match="--workers 2: several workers run on a CPU"):
        worker_plan(2, None, device="cuda:0", backend="sglang", cores=16, num_batches=9)


def test_cli_main_starts_workers_on_a_cpu(tmp_path, monkeypatch):
    from draftforge.data import regenerate as regen_module
    from draftforge.data.answer_workers import WorkerPool

    seen = {}
    monkeypatch.setattr(regen_module, "regenerate",
                        lambda prompts, engine, settings, out, progress, arithmetic:
                        seen.update(engine=engine, arithmetic=arithmetic))
    monkeypatch.setattr(regen_module, "usable_cores", lambda: 4)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    args = [str(recipe), f"train.output_dir={tmp_path}", "data.num_samples=7",
            "target.generation.batch_size=2", "--no-progress"]
    assert regen_module.main(args) == 0
    pool = seen["engine"]
    assert isinstance(pool, WorkerPool) and pool.workers == 4 and pool.name == "random"
    assert pool.build.args[0].num_threads == 1  # 4 cores among 4 workers
    assert regen_module.main(args + ["--workers", "2", "--threads", "3"]) == 0
    assert (seen["engine"].workers, seen["engine"].build.args[0].num_threads) == (2, 3)
    assert seen["arithmetic"]["threads"] == 3 and seen["engine"].quiet  # --no-progress
    assert regen_module.main(args + ["--workers", "1"]) == 0
    assert not isinstance(seen["engine"], WorkerPool)


@pytest.mark.integration
def test_smollm2_answers_do_not_depend_on_the_number_of_workers(tmp_path):
    """Two one-thread workers write the file one two-thread process writes, byte for byte."""
    import functools

    from draftforge.data.answer_workers import WorkerPool
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target

    settings = GenerationConfig(batch_size=2, max_new_tokens=16, temperature=0.7, seed=3)
    prompts = [Conversation(f"q{i}", [{"role": "user", "content": text}]) for i, text in enumerate(
        ["Name a fruit.", "What is 12 + 30?", "Say hello in French.", "Write a haiku about rain.",
         "List three colours."])]
    one = tmp_path / "one.jsonl"
    regenerate(prompts, build_target(TargetConfig(model="smollm2-135m-instruct", dtype="float32",
                                                  num_threads=2), [1]),
               settings, one, progress=False)
    two = tmp_path / "two.jsonl"
    target = TargetConfig(model="smollm2-135m-instruct", dtype="float32", num_threads=1)
    regenerate(prompts, WorkerPool(functools.partial(build_target, target, [1]), 2,
                                   "smollm2-135m-instruct"), settings, two, progress=False)
    assert two.read_bytes() == one.read_bytes()
    assert len(one.read_text().splitlines()) == 5


CTRL_C_DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from regenerate_helpers import SETTINGS, build_slow_engine, make_prompts
from draftforge.data.answer_workers import WorkerPool
from draftforge.data.regenerate import regenerate
if __name__ == "__main__":
    try:
        regenerate(make_prompts(40), WorkerPool(build_slow_engine, 2, "fake-target"), SETTINGS,
                   {out!r}, progress=False)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
"""


def test_ctrl_c_stops_the_workers_keeps_finished_batches_and_leaks_nothing(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "x.jsonl"
    partial = Path(str(out) + ".partial")
    driver = tmp_path / "driver.py"
    driver.write_text(CTRL_C_DRIVER.format(tests=str(Path(__file__).parent), out=str(out)))
    process = subprocess.Popen([sys.executable, str(driver)], start_new_session=True,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().count("\n") >= 6):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "interrupted" in err, err
    assert "leaked" not in err and "Traceback" not in err, err
    assert not out.exists()
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(rows) % 3 == 0 and 6 <= len(rows) < 40  # whole batches of 3 only
    deadline = time.monotonic() + 15  # the workers, and multiprocessing's resource tracker
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("processes of the run are still alive 15 s after it ended")


def test_check_answers_refuses_a_prompts_file(tmp_path):
    """data.regenerated_file pointing at the prompts: refused at its first row, not a KeyError."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"id": "p00", "prompt": "question 0"}) + "\n")
    with pytest.raises(RegenerationError, match=rf"{re.escape(str(path))}, line 1: not a regenerated row"):
        check_answers(path, make_prompts(1), SETTINGS, "fake-target")
    rows = [{"id": "p00", "messages": "question 0"}, {"id": "p01", "messages": [{"role": "user"}]}]
    for row in rows:
        path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(RegenerationError, match=rf"{re.escape(str(path))}, line 1: not a regenerated row"):
            check_answers(path, make_prompts(2), SETTINGS, "fake-target")


def test_answers_of_another_folder_of_the_same_name_are_refused(tmp_path):
    """Two runs' 'final' folders: the rows record a fingerprint of the weights besides the name."""
    from safetensors.torch import save_file

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import target_name

    names = []
    for run_name, value in (("sft-v1", 1.0), ("sft-v2", 2.0)):
        folder = tmp_path / run_name / "final"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"model_type": "llama"}')
        save_file({"w": torch.full((4,), value)}, str(folder / "model.safetensors"))
        names.append(target_name(TargetConfig(model=str(folder))))
    engine = FakeEngine()
    engine.name = names[0]
    out, _ = run(tmp_path, "r.jsonl", engine, prompts=make_prompts(4))
    check_answers(out, make_prompts(4), SETTINGS, names[0])
    with pytest.raises(RegenerationError, match=rf"{re.escape(str(out))}, line 1 \(id 'p00'\) holds answers of target "
                       rf"'final' \(fingerprint {names[0].fingerprint}\), but this run's target 'final' "
                       rf"is another model of that name \(fingerprint {names[1].fingerprint}\)"):
        check_answers(out, make_prompts(4), SETTINGS, names[1])
    with pytest.raises(RegenerationError, match="another model of that name"):
        run(tmp_path, "r.jsonl", FakeEngineNamed(names[1]), prompts=make_prompts(5))
    # rows written before fingerprints were recorded are accepted on the name alone
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row.pop("target_fingerprint") for row in rows} == {names[0].fingerprint}
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    check_answers(out, make_prompts(4), SETTINGS, names[1])


def test_answers_of_a_renamed_copy_of_the_target_folder_are_accepted(tmp_path):
    """The fingerprint reads the folder's files, not its path: the same model under another
    name answers the same, so its answers are reused (checked, and continued by a rerun);
    a folder of that new name holding other weights is still refused."""
    import shutil

    from safetensors.torch import save_file

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import target_name

    first = tmp_path / "runs" / "final"
    first.mkdir(parents=True)
    (first / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.full((4,), 1.0)}, str(first / "model.safetensors"))
    moved = tmp_path / "models" / "sft-v1"
    shutil.copytree(first, moved)
    other = tmp_path / "other" / "sft-v1"
    shutil.copytree(first, other)
    save_file({"w": torch.full((4,), 2.0)}, str(other / "model.safetensors"))
    names = [target_name(TargetConfig(model=str(folder))) for folder in (first, moved, other)]
    assert names[0] != names[1] and names[0].fingerprint == names[1].fingerprint

    engine = FakeEngine()
    engine.name = names[0]
    out, _ = run(tmp_path, "r.jsonl", engine, prompts=make_prompts(4))
    check_answers(out, make_prompts(4), SETTINGS, names[1])
    out, _ = run(tmp_path, "r.jsonl", FakeEngineNamed(names[1]), prompts=make_prompts(6))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # batches of 3: the short last batch (p03) is answered again with the batch it now starts
    assert [row["target"] for row in rows] == ["final"] * 3 + ["sft-v1"] * 3
    check_answers(out, make_prompts(6), SETTINGS, names[1])
    with pytest.raises(RegenerationError, match=r"line 1 \(id 'p00'\) holds answers of target 'final', "
                       r"but this run's target is 'sft-v1'"):
        check_answers(out, make_prompts(6), SETTINGS, names[2])


class FakeEngineNamed(FakeEngine):
    def __init__(self, name):
        super().__init__()
        self.name = name


def test_a_template_failure_names_the_prompt(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from draftforge.data.tokenize import ChatTemplateError
    from draftforge.splitserve.target import render_prompt

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer())
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")  # fmt: skip

    class Rendering(FakeEngine):
        def generate(self, conversations, settings):
            for index, conversation in enumerate(conversations):
                render_prompt(tokenizer, conversation, index, settings)
            return super().generate(conversations, settings)

    prompts = [Conversation("plain", [{"role": "user", "content": "a"}]),
               Conversation("sys", [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}],
                            source="prompts.jsonl, line 2")]  # fmt: skip
    with pytest.raises(ChatTemplateError, match=r"prompts.jsonl, line 2 \(id 'sys'\): the chat template "
                                                r"fails on this prompt \(System role not supported\)"):
        run(tmp_path, "r.jsonl", Rendering(), prompts=prompts)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return backend
