"""Round 18 leftovers: a reply that starts with two or more whitespace characters, and a
``draftforge eval --calibrate`` path the report overwrote.

The server tokenises the prompt (the conversation up to the generation prompt) alone, then
the target generates the reply's tokens. Tokenised as one string, SmolLM2's byte-level BPE
merged the generation prompt's newline with the reply's first spaces: the training sample's
prompt ended in a token the server never sends (``ĊĠĠĠ`` for ``Ċ``) and the reply's first
whitespace went unsupervised. The expected ids are computed here with the tokenizer and
the chat template alone: the served prompt's ids, then the ids of the text after it.
"""

from __future__ import annotations

import json

import pytest
from eval_helpers import random_prompts
from test_data_tokenize import smollm2_tokenizer  # noqa: F401  (fixture)
from test_eval_cli import _tiny_export_and_prompts, recipe_path  # noqa: F401  (fixture)

from draftforge.data.tokenize import tokenize_messages


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.integration
@pytest.mark.parametrize("reply", ["    return x + 1", "  a = 1", "\n\nHello", " \nfoo", " x = 1", "Hi"])
def test_a_reply_is_tokenized_as_the_server_sends_its_prompt_and_the_target_generates_it(
    smollm2_tokenizer, reply
):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "Complete the function"}, {"role": "assistant", "content": reply}]
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(messages, tokenize=False)
    assert whole.startswith(prompt) and prompt.endswith("assistant\n")
    served = _ids(tok, prompt)
    generated = _ids(tok, reply + "<|im_end|>")  # the reply and the end-of-turn marker serving stops at

    ids, mask = tokenize_messages(tok, messages)
    assert ids == served + _ids(tok, whole[len(prompt):])
    assert [i for i, m in zip(ids, mask, strict=True) if m] == generated
    assert mask[: len(served)] == [0] * len(served) and mask[len(served)] == 1


@pytest.mark.integration
def test_every_turn_of_a_conversation_starts_where_its_served_prompt_ends(smollm2_tokenizer):
    tok = smollm2_tokenizer
    replies = ["   def f():\n        pass", "\n\n  42"]
    messages = [{"role": "user", "content": "Write f"}, {"role": "assistant", "content": replies[0]},
                {"role": "user", "content": "And the answer?"}, {"role": "assistant", "content": replies[1]}]
    ids, mask = tokenize_messages(tok, messages)

    assert [i for i, m in zip(ids, mask, strict=True) if m] == [
        i for reply in replies for i in _ids(tok, reply + "<|im_end|>")
    ]
    starts = [n for n in range(len(mask)) if mask[n] and not mask[n - 1]]
    assert len(starts) == 2
    for start in starts:  # the served prompt ends with the generation prompt's own newline token
        assert tok.convert_ids_to_tokens(ids[start - 3 : start]) == ["ass", "istant", "Ċ"]
    # what comes before the last reply spells that turn's served prompt
    assert tok.decode(ids[: starts[1]]) == tok.apply_chat_template(messages[:3], tokenize=False,
                                                                   add_generation_prompt=True)


def test_a_calibration_path_the_report_writes_over_is_refused_before_the_target_loads(
        recipe_path, tmp_path, capsys, monkeypatch):
    """--calibrate OUT/report.json: the calibration was written, then the report replaced it;
    the run said 'calibration written to OUT/report.json' and exited 0 with the fit lost."""
    import draftforge.splitserve.target as target_module
    from draftforge.cli import main
    from draftforge.eval.cli import _check_output_paths

    export_dir, prompts = _tiny_export_and_prompts(recipe_path, tmp_path)
    prompts.write_text("\n".join(json.dumps({"workload": "w", "input_ids": ids}) for ids in random_prompts(2)))
    monkeypatch.setattr(target_module, "build_target", lambda *a, **kw: pytest.fail("the target loaded"))
    out = tmp_path / "r"
    base = ["eval", str(export_dir), "--recipe", str(recipe_path), "--prompts-file", str(prompts), "--out", str(out)]
    for calibrate in (out / "report.json", out / "report.md", tmp_path / "x" / ".." / "r" / "acceptance_length.png"):
        assert main([*base, "--calibrate", str(calibrate)]) == 2, calibrate
        err = capsys.readouterr().err
        assert f"draftforge eval: error: --calibrate {calibrate}: is the report's {calibrate.name} in --out {out}, " \
               "which the report would write over the calibration; give another path, " \
               f"e.g. {out / 'calibration.json'}" in err, err
    assert not out.exists()
    _check_output_paths(str(out), str(out / "calibration.json"))  # beside the report: accepted
    _check_output_paths(str(out), str(tmp_path / "report.json"))  # not the report's folder


@pytest.mark.parametrize("module,positional", [("cli", "some/draft"), ("demo", "recipe.yaml"),
                                                ("llamacpp_check", "some/export")])
@pytest.mark.parametrize("given", [",", "", " , "])
def test_an_empty_workloads_list_says_no_name_was_given(module, positional, given, capsys):
    """draftforge eval, demo and eval llamacpp said 'unknown empty list' for --workloads ','."""
    import importlib

    parser = importlib.import_module(f"draftforge.eval.{module}").build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args([positional, "--workloads", given])
    assert info.value.code == 2
    assert "argument --workloads: no name given; valid: humaneval, mtbench, gsm8k\n" in capsys.readouterr().err
