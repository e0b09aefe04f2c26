"""SGLang backend, round 28: checked against SGLang 0.5.23's own source, without SGLang installed.

A prompt whose reply could run past the target's positions is refused before SGLang sees the
batch, naming its conversation, as the transformers backend refuses it
(``splitserve.target.check_context``). SGLang 0.5.23 refuses such a request itself:
``TokenizerManager._validate_one_request`` (``sglang/srt/managers/tokenizer_manager.py``,
lines 1352-1378) raises ``ValueError("Requested token count exceeds the model's maximum
context length ...")`` when ``max_new_tokens + len(input_ids) > context_len``, and
``_batch_tokenize_and_process`` (line 1711) validates every request of a batch that way, so
the whole ``Engine.generate`` call failed naming no prompt, and regeneration could not say
which prompt file, line and id to shorten.
"""

from __future__ import annotations

import json

import pytest
from test_sglang_backend import fake_target, folder, model  # noqa: F401  (fixtures)

from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.target import render_prompt


class _NoEngine:
    def generate(self, input_ids, sampling_params):
        raise AssertionError("SGLang saw the prompts")


def test_a_prompt_that_runs_past_the_context_is_refused_naming_its_conversation(fake_target, folder):
    fake_target._engine = _NoEngine()
    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    conversations = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "w2 w3 w4"}]]
    settings = GenerationConfig(temperature=0.0, max_new_tokens=2)
    lengths = [len(fake_target.tokenizer(render_prompt(fake_target.tokenizer, c, i, settings),
                                         add_special_tokens=False)["input_ids"])
               for i, c in enumerate(conversations)]
    assert lengths[0] < lengths[1]
    # the first prompt and its reply fill the context exactly; the second's run one past it
    settings = GenerationConfig(temperature=0.0, max_new_tokens=context - lengths[0])
    with pytest.raises(InputError) as err:
        fake_target.generate(conversations, settings)
    assert err.value.conversation_index == 1
    assert "the prompt of conversation 1 has" in str(err.value)
    assert f"max_position_embeddings {context}" in str(err.value)


def test_a_prompt_that_fits_the_context_reaches_sglang(fake_target):
    class Engine:
        def generate(self, input_ids, sampling_params):
            return [{"output_ids": [], "meta_info": {"finish_reason": {"type": "length"}}}
                    for _ in input_ids]

    fake_target._engine = Engine()
    replies = fake_target.generate([[{"role": "user", "content": "w1"}]],
                                   GenerationConfig(temperature=0.0, max_new_tokens=2))
    assert [str(r) for r in replies] == [""]
