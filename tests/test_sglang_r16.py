"""SGLang backend, round 16: as the transformers backend does, a prompt the embedding cannot
look up carries its conversation's index (so regeneration names the prompt's file, line and
id), and a generation_config.json that does not parse is refused naming it (its end-of-turn
ids were a JSONDecodeError traceback)."""

from __future__ import annotations

import pytest
from test_sglang_backend import fake_target, folder, model  # noqa: F401  (fixtures)

from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.target import folder_eos_ids


def test_a_prompt_beyond_the_embedding_carries_its_conversation_index(fake_target):
    class Engine:
        def generate(self, input_ids, sampling_params):
            raise AssertionError("SGLang saw the prompts")

    fake_target._engine = Engine()
    fake_target.tokenizer.add_tokens(["w-added"])  # a token added without resizing the embedding
    conversations = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "w2"}],
                     [{"role": "user", "content": "w3 w-added"}]]
    with pytest.raises(InputError) as err:
        fake_target.generate(conversations, GenerationConfig(temperature=0.0, max_new_tokens=2))
    assert err.value.conversation_index == 2


def test_a_generation_config_that_does_not_parse_is_refused_naming_it(fake_target, tmp_path):
    config = tmp_path / "generation_config.json"
    config.write_text('{"eos_token_id": [2, 7],}\n')
    with pytest.raises(InputError) as err:
        folder_eos_ids(fake_target.tokenizer, tmp_path)
    assert str(err.value).startswith(f"{config} is not valid JSON (")
    assert "line 1 column" in str(err.value) and "eos_token_id" in str(err.value)
    config.write_text('{"eos_token_id": [2, 7]}\n')
    assert set(folder_eos_ids(fake_target.tokenizer, tmp_path)) >= {2, 7}
