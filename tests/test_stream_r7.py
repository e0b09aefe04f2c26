"""Resuming a run that regenerates its answers inline: the conversations dropped for
data.min_loss_tokens are recorded in the data cursor, so their chunks are not answered again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from splitserve_helpers import metrics, run_on_ranks, tiny_recipe
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer


def regenerating_rank(recipe: str, calls: str, dropped: str, *overrides: str) -> None:
    """One rank of ``draftforge.train`` whose target answers every prompt by repeating its
    topic (``dropped`` gets a reply too short to train on), logging each chunk it answers
    to ``calls`` (a JSON list of the prompt ids a line)."""
    from draftforge.data import regenerate

    def answer_batch(prompts, engine, settings):
        with open(calls, "a") as handle:
            handle.write(json.dumps([p.id for p in prompts]) + "\n")
        histories = []
        for p in prompts:  # "Repeat <three words> a few times."
            reply = "ok" if p.id == dropped else " ".join(p.user_turns[0].split()[1:4] * 4)
            histories.append([{"role": "user", "content": p.user_turns[0]},
                              {"role": "assistant", "content": reply}])
        return histories, [[] for _ in prompts], [[None, None] for _ in prompts]

    regenerate.answer_batch = answer_batch  # the producer looks it up at each chunk
    from draftforge.train.__main__ import main

    sys.exit(main([recipe, *overrides]))


def _run(recipe: Path, calls: Path, dropped: str, *overrides: str) -> list[list[str]]:
    """Run the job (one target rank, one trainer); the chunks its target answered."""
    args = ", ".join(repr(a) for a in (str(recipe), str(calls), dropped, *overrides))
    codes, logs = run_on_ranks(f"import test_stream_r7 as t; t.regenerating_rank({args})", 2, 180)
    assert codes == [0, 0], logs
    return [json.loads(line) for line in calls.read_text().splitlines()]


def _steps(run_dir: Path) -> dict[int, list[str]]:
    return {r["step"]: r["sample_ids"] for r in metrics(run_dir) if "sample_ids" in r}


@pytest.mark.distributed
def test_a_resumed_inline_regenerating_run_does_not_answer_consumed_chunks_again(tmp_path):
    """A chunk holding a conversation dropped for data.min_loss_tokens was never wholly
    consumed, so every resume answered it again (a whole generation batch). The trainers now
    record the dropped id with the sample that told them of it; the resume skips the chunk and
    still trains on exactly the samples an uninterrupted run does."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )

    def recipe(name: str) -> Path:
        (tmp_path / name).mkdir()
        return tiny_recipe(tmp_path / name, steps=4, overrides={"data.regenerate": True,
                                                              "train.checkpoint_interval": 2})

    reference_recipe = recipe("reference")
    cfg = load_recipe(reference_recipe)
    conversations, regenerate = load_source_conversations(cfg)
    assert regenerate  # no regenerated file: the target answers inline
    source = SampleSource(cfg, None, build_topology(cfg.split), 0, conversations=conversations,
                          regenerate=True)
    first_chunk = [conversations[i].id for i in source.chunks()[0]]
    dropped = first_chunk[1]

    _run(reference_recipe, tmp_path / "reference" / "calls.jsonl", dropped)
    reference = _steps(tmp_path / "reference" / "run")
    assert sorted(reference) == list(range(1, 5))

    cut = recipe("cut")
    first_calls = _run(cut, tmp_path / "cut" / "calls.jsonl", dropped, "train.steps=2")
    state = json.loads((tmp_path / "cut" / "run" / "checkpoints" / "step_00000002" /
                        "trainer_state.json").read_text())
    done = set(state["consumed_ids"][0]) | {dropped}
    assert set(first_chunk) <= done  # the chunk with the dropped conversation was consumed
    calls = _run(cut, tmp_path / "cut" / "calls.jsonl", dropped)[len(first_calls):]
    assert calls and all(not set(chunk) <= done for chunk in calls), calls  # none answered again
    assert state["dropped_ids"] == [[dropped]]
    resumed = _steps(tmp_path / "cut" / "run")
    assert resumed == reference
    assert all(dropped not in ids for ids in reference.values())


def test_the_cursor_records_the_dropped_ids_a_sample_carries_and_old_checkpoints_resume(tmp_path):
    """Dropped ids come with the sample that told of them (its provenance) and are saved once
    its step is; a checkpoint written before they were recorded resumes with none."""
    samples = chain_samples(24)
    samples[2].provenance["dropped_ids"] = ("gone-1", "gone-2")
    samples[20].provenance["dropped_ids"] = ("gone-3",)  # not trained within 2 steps

    def trainer(**overrides) -> Trainer:
        return Trainer(model_config=tiny_model_config(), train=train_config(**overrides),
                       embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: test\n")

    first = trainer(steps=2)
    result = first.fit(pack(samples, 90))
    trained = [i for ids in result.sample_ids for i in ids]
    assert samples[2].sample_id in trained and samples[20].sample_id not in trained
    path = ckpt.checkpoint_path(tmp_path, 2)
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["dropped_ids"] == [["gone-1", "gone-2"]]

    info = trainer(steps=4, resume="auto").resume()
    assert set(info.all_consumed) == {*trained, "gone-1", "gone-2"}
    assert info.consumed_ids == trained

    del state["dropped_ids"]  # as written before the field existed
    state_file.write_text(json.dumps(state))
    old = trainer(steps=4, resume="auto")
    info = old.resume()
    assert set(info.all_consumed) == set(trained) and old.dropped_ids == []
