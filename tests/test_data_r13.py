"""Review round 13 of data preparation: what 'data regenerate' writes must be what training
reads (data.regenerate, the file's name, a file cut short), SpecForge's row layout, chat
templates that render no reply, a prompt the template refuses with several workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from regenerate_helpers import FakeEngine
from test_data_tokenize import CHATML, CONVERSATION, EXPECTED, chatml_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"


def _no_target(monkeypatch):
    """Regeneration that reaches the target fails the test: the refusals come before it."""
    import draftforge.splitserve.target as target_module

    built = []

    def fake_build_target(cfg, layer_ids, *, device, tensor_parallel):
        built.append(cfg.model)
        return FakeEngine()

    monkeypatch.setattr(target_module, "build_target", fake_build_target)
    return built


def _prompts(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "bye"}\n')
    return data


def test_regenerating_for_a_recipe_that_trains_on_its_files_as_they_are_is_refused(
    tmp_path, monkeypatch, capsys
):
    """With data.regenerate false training reads the replies of data.train_files and never the
    regenerated file: 'data regenerate' answered every prompt (hours on a real target), exited
    0, and the draft then learnt the dataset's replies, not the target's."""
    from draftforge.data.regenerate import main

    built = _no_target(monkeypatch)
    status = main([str(RECIPE), f"data.train_files=['{_prompts(tmp_path)}']",
                   "data.regenerate=false", f"train.output_dir={tmp_path / 'run'}", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err == (
        "draftforge data regenerate: data.regenerate is false: training reads the replies of "
        "data.train_files as they are and would never read the target's answers written here; "
        "set data.regenerate: true (in the recipe, or data.regenerate=true for this command and "
        "for 'draftforge train') to train on them\n"
    )
    assert built == [] and not (tmp_path / "run").exists()
    # with data.regenerate true (the recipe's) the same command answers them
    assert main([str(RECIPE), f"data.train_files=['{_prompts(tmp_path)}']",
                 f"train.output_dir={tmp_path / 'run'}", "--no-progress"]) == 0
    rows = (tmp_path / "run" / "regenerated.jsonl").read_text().splitlines()
    assert [json.loads(r)["id"] for r in rows] == ["a", "b"]


@pytest.mark.parametrize("name", ["answers.jsonl.gz", "answers.json", "answers.parquet", "answers.txt"])
def test_a_regenerated_file_training_could_not_read_is_refused_before_any_answer(
    tmp_path, monkeypatch, capsys, name
):
    """The answers are plain JSON lines whatever the name; training reads a data file by its
    extension, so answers.jsonl.gz ('Not a gzipped file'), answers.json ('Extra data') and the
    rest were written in full and refused only when training started."""
    from draftforge.data.config import DataConfig
    from draftforge.data.loading import load_training_conversations
    from draftforge.data.regenerate import main

    built = _no_target(monkeypatch)
    out = tmp_path / "run" / name
    status = main([str(RECIPE), f"data.train_files=['{_prompts(tmp_path)}']",
                   f"data.regenerated_file={out}", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err == (
        f"draftforge data regenerate: data.regenerated_file {out}: the answers are written as "
        "plain JSON lines, which training reads only from a file whose name ends in .jsonl (not "
        "compressed, not .json or .parquet); give a .jsonl file path\n"
    )
    assert built == [] and not out.parent.exists()
    # a .jsonl name (any case) is written and read back as training conversations
    for good in ("answers.jsonl", "ANSWERS.JSONL"):
        out = tmp_path / "run" / good
        assert main([str(RECIPE), f"data.train_files=['{_prompts(tmp_path)}']",
                     f"data.regenerated_file={out}", "--no-progress"]) == 0
        loaded = load_training_conversations(
            DataConfig(regenerated_file=str(out), overlap_check=False), tmp_path)
        assert [c.id for c in loaded.conversations] == ["a", "b"]


SPECFORGE_ROWS = [  # scripts/prepare_data.py of SpecForge: {"id", "conversations": [{role, content}]}
    {"id": "u1", "conversations": [{"role": "user", "content": "Name a prime."},
                                   {"role": "assistant", "content": "7 is prime."},
                                   {"role": "user", "content": "Another?"},
                                   {"role": "assistant", "content": "11."}]},
    {"id": "u2", "conversations": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}]},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_specforge_prepared_data_loads_as_the_same_conversations_in_messages_form(tmp_path, suffix):
    """SpecForge writes its prepared ShareGPT/UltraChat data under 'conversations' with OpenAI's
    role/content turns; every row was refused ("turn 1 has no 'from'")."""
    from draftforge.data.loading import load_conversations

    def write(path, rows):
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    specforge, reference = tmp_path / f"specforge{suffix}", tmp_path / f"openai{suffix}"
    write(specforge, SPECFORGE_ROWS)
    write(reference, [{"id": r["id"], "messages": r["conversations"]} for r in SPECFORGE_ROWS])
    for fmt in ("auto", "sharegpt"):
        for expect in ("conversation", "prompt"):
            got = load_conversations([str(specforge)], fmt=fmt, expect=expect).conversations
            want = load_conversations([str(reference)], expect=expect).conversations
            assert [(c.id, c.messages) for c in got] == [(c.id, c.messages) for c in want]
    assert got[1].messages == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"}]  # expect="prompt": no replies


def test_role_content_turns_are_checked_as_strictly_as_from_value_turns(tmp_path):
    from draftforge.data.formats import DataFormatError
    from draftforge.data.loading import load_conversations

    path = tmp_path / "d.jsonl"
    cases = [
        ([{"role": "human", "content": "q"}], "turn 1 has 'role' 'human'; valid values: system, user, assistant"),
        ([{"role": "user"}], "turn 1 (user) has no 'content'"),
        ([{"role": "user", "content": 3}], "turn 1 (user) content must be a string, got int"),
        ([{"content": "q"}], "turn 1 has no 'from' (nor 'role')"),
        ([{"from": "human", "value": "q"}, {"role": "user", "content": "again"}],
         "turn 2 is 'user' where 'assistant' is expected"),
    ]
    for turns, message in cases:
        path.write_text(json.dumps({"conversations": turns}) + "\n")
        with pytest.raises(DataFormatError) as err:
            load_conversations([str(path)], expect="conversation")
        assert str(err.value).startswith(f"{path}, line 1: {message}"), str(err.value)


@pytest.mark.parametrize("unfinished", [(), (2, 4)])
def test_a_chat_template_that_renders_no_reply_is_refused_not_every_sample_dropped(tmp_path, unfinished):
    """target.generation.chat_template set to a file path ('templates/chatml.jinja', as SGLang's
    --chat-template takes one) renders that text for every conversation: no reply is in it, every
    sample was dropped as having too few supervised tokens (or a cut reply was said to be
    rewritten), and training stopped blaming data.min_loss_tokens."""
    from draftforge.data.formats import Conversation
    from draftforge.data.tokenize import ChatTemplateError, tokenize_conversations

    tok = chatml_tokenizer()
    conv = Conversation("c1", CONVERSATION, source=f"{tmp_path / 'r.jsonl'}, line 3",
                        extra={"unfinished_turns": list(unfinished)})
    with pytest.raises(ChatTemplateError) as err:
        tokenize_conversations([conv], tok, max_length=64, min_loss_tokens=1,
                               chat_template="templates/chatml.jinja")
    assert str(err.value) == (
        f"{tmp_path / 'r.jsonl'}, line 3 (id 'c1'): the chat template renders message 3 (assistant) as "
        "nothing (neither its text nor an end-of-turn marker), so none of it can be supervised; "
        "target.generation.chat_template takes the template's Jinja text, not a file path"
    )
    # the template's text itself: the hand-written tokens and mask
    samples, stats = tokenize_conversations([conv], tok, max_length=64, min_loss_tokens=1,
                                            chat_template=CHATML)
    expected = [(t, m) for t, m in EXPECTED]
    if unfinished:  # the cut replies' end markers were never generated
        assert expected[22] == expected[-2] == ("<|im_end|>", 1)
        expected[22] = expected[-2] = ("<|im_end|>", 0)
    assert list(zip(tok.convert_ids_to_tokens(samples[0].input_ids), samples[0].loss_mask,
                    strict=True)) == expected
    assert stats.num_dropped_short == 0
    # an empty reply rendered as nothing is no template fault: nothing was generated
    empty = "{% for m in messages %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% endfor %}"
    _, stats = tokenize_conversations(
        [Conversation("c2", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])],
        tok, max_length=64, min_loss_tokens=1, chat_template=empty)
    assert stats.num_dropped_short == 1


@pytest.mark.parametrize("cut", [30, 5, "first line", "blank line"])
def test_a_finished_file_cut_short_is_continued_as_training_says_not_refused(tmp_path, capsys, cut):
    """A regenerated file copied with a cut (disk full, an interrupted scp): training refused it
    with "rerun 'draftforge data regenerate' to rewrite it", and that rerun refused it in turn
    ("it was not written here"), so every answer had to be thrown away. The rerun now keeps its
    whole rows, answers the cut row's batch again and writes the uninterrupted run's file."""
    from regenerate_helpers import SETTINGS, make_prompts

    from draftforge.data.regenerate import RegenerationError, check_answers, regenerate

    reference = tmp_path / "reference.jsonl"
    regenerate(make_prompts(11), FakeEngine(), SETTINGS, reference, progress=False)
    whole = reference.read_bytes()
    lines = whole.splitlines(keepends=True)
    out = tmp_path / "copied.jsonl"
    if cut == "first line":
        out.write_bytes(lines[0][:40])
    elif cut == "blank line":  # an editor's empty last line: no row is cut, the file is rewritten
        out.write_bytes(whole + b"\n")
    else:
        out.write_bytes(whole[:-cut])
    with pytest.raises(RegenerationError, match="ends with an incomplete line; rerun 'draftforge data regenerate'"):
        check_answers(out, make_prompts(11), SETTINGS, "fake-target")
    capsys.readouterr()
    engine = FakeEngine()
    report = regenerate(make_prompts(11), engine, SETTINGS, out, progress=False)
    assert f"{out} ends with an incomplete line; continuing from its whole rows" in capsys.readouterr().err
    assert out.read_bytes() == whole
    assert not out.with_name(out.name + ".partial").exists()
    check_answers(out, make_prompts(11), SETTINGS, "fake-target")
    # the last batch (p09, p10) is answered again when p10's row was cut; every batch when the
    # first line was; none when no row was
    answered = {"first line": 11, "blank line": 0}.get(cut, 2)
    assert (report.num_generated, report.num_reused) == (answered, 11 - answered)
    asked = {c[-1]["content"] for convs, _ in engine.calls for c in convs
             if c[-1]["content"].startswith("question")}
    assert asked == {f"question {i}" for i in range(11 - answered, 11)}


ENGINES = '''
from jinja2 import TemplateError
from regenerate_helpers import FakeEngine

from draftforge.data.tokenize import template_failure


class NoSystemRole(FakeEngine):
    """Renders as Gemma's template does: raise_exception('System role not supported')."""

    def generate(self, conversations, settings):
        for index, conversation in enumerate(conversations):
            if conversation[0]["role"] == "system":
                error = template_failure(TemplateError("System role not supported"), f"conversation {index}")
                error.conversation_index = index
                raise error from TemplateError("System role not supported")
        return super().generate(conversations, settings)


def build_no_system_role():
    return NoSystemRole()
'''


def test_a_prompt_the_template_refuses_is_the_same_message_with_workers_as_without(tmp_path, monkeypatch):
    """With several workers (the default on a CPU) a prompt the chat template refuses (a system
    prompt for Gemma's template) was reported as a crash: "regeneration worker 0 failed while
    answering batch 0: ChatTemplateError: ..." and the worker's traceback. It is the input's
    fault, named as one process names it, and the command's one-line error."""
    from regenerate_helpers import SETTINGS, make_prompts

    from draftforge.data.answer_workers import WorkerError, WorkerPool
    from draftforge.data.regenerate import regenerate
    from draftforge.data.tokenize import ChatTemplateError

    (tmp_path / "r13_engines.py").write_text(ENGINES)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers take this sys.path too
    import r13_engines

    prompts = make_prompts(6)  # p00 and p04 have a system prompt
    with pytest.raises(ChatTemplateError) as alone:
        regenerate(prompts, r13_engines.build_no_system_role(), SETTINGS, tmp_path / "one.jsonl",
                   progress=False)
    assert str(alone.value).startswith("prompt (id 'p00'): the chat template fails on this prompt "
                                       "(System role not supported)")
    pool = WorkerPool(r13_engines.build_no_system_role, 2, name="fake-target")
    with pytest.raises(WorkerError) as workers:
        regenerate(prompts, pool, SETTINGS, tmp_path / "two.jsonl", progress=False)
    assert str(workers.value) in (str(alone.value), str(alone.value).replace("p00", "p04"))
