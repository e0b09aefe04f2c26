"""Session 56: inputs a data review found read silently wrong, each refused at its row.

- an empty assistant reply in conversations trained as they are (it taught the draft to end
  the turn at once), while the target's own empty answer stays trainable;
- reasoning kept beside the content as text parts or an object (only a string was seen);
- a row's tool definitions, which never reached the chat template;
- an empty data file that data.num_samples left unread (refused only when it was read)."""

from __future__ import annotations

import json

import pytest

from draftforge.data.config import DataConfig
from draftforge.data.formats import DataFormatError
from draftforge.data.loading import load_prompts, load_training_conversations


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat(*replies, **extra):
    messages = []
    for n, reply in enumerate(replies):
        messages += [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": reply}]
    return {"messages": messages, **extra}


def _as_is(tmp_path, rows, **settings):
    path = _write(tmp_path / "chats.jsonl", rows)
    cfg = DataConfig(train_files=[str(path)], regenerate=False, overlap_check=False, **settings)
    return path, cfg


@pytest.mark.parametrize("empty", ["", "   "])
def test_an_empty_reply_trained_as_it_is_is_refused_at_its_row(tmp_path, empty):
    path, cfg = _as_is(tmp_path, [_chat("fine"), _chat(empty, "ok fine")])
    with pytest.raises(DataFormatError) as info:
        load_training_conversations(cfg, tmp_path)
    assert str(info.value) == (
        f"{path}, line 2: message 2 (assistant) is empty: trained as it is, it would teach the draft to "
        "end the turn at once; fill the reply, remove it with the user turn before it, or set "
        "data.regenerate: true to have the target answer")
    cfg = cfg.model_copy(update={"skip_invalid": True})  # skipped, with the others kept
    assert [c.id for c in load_training_conversations(cfg, tmp_path).conversations] == ["chats-1"]


def test_the_targets_own_empty_answer_is_trained_on(tmp_path):
    """A regenerated file holds what the target did: an answer that ends at once is one."""
    answers = _write(tmp_path / "regenerated.jsonl", [_chat(""), _chat("ok")])
    cfg = DataConfig(regenerate=True, regenerated_file=str(answers), overlap_check=False)
    assert len(load_training_conversations(cfg, tmp_path).conversations) == 2


@pytest.mark.parametrize("reasoning", [[{"type": "text", "text": "2 plus 2 is 4"}], {"text": "2 plus 2"}])
@pytest.mark.parametrize("key", ["reasoning_content", "thinking"])
def test_reasoning_that_is_not_a_string_is_refused_as_a_string_is(tmp_path, key, reasoning):
    row = _chat("The answer is 4.")
    row["messages"][1][key] = reasoning
    path, cfg = _as_is(tmp_path, [row])
    with pytest.raises(DataFormatError, match=f"message 2 \\(assistant\\) has its reasoning in '{key}'"):
        load_training_conversations(cfg, tmp_path)
    row["messages"][1][key] = [] if isinstance(reasoning, list) else {}  # empty: nothing left out
    _write(path, [row])
    assert len(load_training_conversations(cfg, tmp_path).conversations) == 1


@pytest.mark.parametrize("key", ["tools", "functions"])
def test_a_row_defining_tools_is_refused_for_training_and_for_regeneration(tmp_path, key):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    path, cfg = _as_is(tmp_path, [_chat("I can check."), _chat("Yes.", **{key: tools})])
    said = (f"{path}, line 2: the row defines tools in '{key}', which draftforge does not pass to the chat "
            "template: the prompt would be rendered (and answered) without them, not as the target is "
            "served; remove the key to train without tools, or the row")
    with pytest.raises(DataFormatError) as info:
        load_training_conversations(cfg, tmp_path)
    assert str(info.value) == said
    with pytest.raises(DataFormatError) as info:
        load_prompts(cfg.model_copy(update={"regenerate": True}), progress=False)
    assert str(info.value) == said
    _write(path, [_chat("Yes.", **{key: []})])  # none defined
    assert len(load_training_conversations(cfg, tmp_path).conversations) == 1


def test_an_empty_file_is_refused_also_when_data_num_samples_leaves_it_unread(tmp_path):
    ok = _write(tmp_path / "ok.jsonl", [_chat("a"), _chat("b")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for num_samples in (None, 1):
        cfg = DataConfig(train_files=[str(ok), str(empty)], regenerate=False, overlap_check=False,
                         num_samples=num_samples)
        with pytest.raises(DataFormatError, match=f"^{empty}: holds no rows"):
            load_training_conversations(cfg, tmp_path)


@pytest.mark.parametrize("weight", [0, 0.0, False, 0.5])
def test_an_assistant_turn_weighted_not_to_be_trained_on_is_refused(tmp_path, weight):
    """axolotl's per-turn 'weight': 0 asked not to train on a reply; draftforge trained on it."""
    row = _chat("first", "second")
    row["messages"][1]["weight"] = weight
    path, cfg = _as_is(tmp_path, [row])
    with pytest.raises(DataFormatError) as info:
        load_training_conversations(cfg, tmp_path)
    assert str(info.value).startswith(
        f"{path}, line 1: message 2 (assistant) has 'weight' {weight!r}: draftforge supervises every "
        "assistant turn of a conversation trained as it is and honours no per-turn weight"), info.value
    row["messages"][1]["weight"] = 1  # trained on: as draftforge does anyway
    row["messages"][0]["weight"] = 0  # a user turn is never trained on
    _write(path, [row])
    assert len(load_training_conversations(cfg, tmp_path).conversations) == 1
