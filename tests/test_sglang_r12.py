"""SGLang backend, round 12: token ids the target's embedding cannot look up are refused
before SGLang sees them, with the transformers backend's message (SGLang would fail inside
its scheduler, or on a GPU with a device-side assert)."""

from __future__ import annotations

import pytest
import torch
from test_sglang_backend import fake_target, folder, model  # noqa: F401  (fixtures)

from draftforge.errors import InputError
from draftforge.splitserve.config import GenerationConfig


def test_features_refuse_an_id_beyond_the_embedding_naming_row_and_position(fake_target):
    rows = fake_target.vocab_size
    ids = torch.tensor([[4, 5, 6, 0], [7, rows, 8, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    with pytest.raises(InputError) as err:
        fake_target.features(ids, mask)
    assert str(err.value).startswith(
        f"target {fake_target.name!r}: features: token id {rows} at row 1, position 1 is outside the "
        f"model's {rows} embedding rows (ids 0..{rows - 1}); the tokenizer and the weights do not match")
    assert fake_target._runner.calls == []  # SGLang never saw them
    with pytest.raises(InputError, match=r"token id -1 .* token ids are never negative"):
        fake_target.features(torch.tensor([[3, -1]]), None)
    fake_target.features(ids[:, :3].clamp(max=rows - 1), mask[:, :3])  # the last row is fine


def test_generate_refuses_a_prompt_the_tokenizer_encodes_beyond_the_embedding(fake_target):
    class Engine:
        calls = 0

        def generate(self, input_ids, sampling_params):
            Engine.calls += 1
            return []

    fake_target._engine = Engine()
    fake_target.tokenizer.add_tokens(["w-added"])  # a token added without resizing the embedding
    added = fake_target.tokenizer.convert_tokens_to_ids("w-added")
    assert added == fake_target.vocab_size
    conversations = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "w2 w-added"}]]
    with pytest.raises(InputError) as err:
        fake_target.generate(conversations, GenerationConfig(temperature=0.0, max_new_tokens=2))
    assert str(err.value).startswith(
        f"target {fake_target.name!r}: the prompt of conversation 1: token id {added} ('w-added' to the "
        f"tokenizer) at position ")
    assert Engine.calls == 0
