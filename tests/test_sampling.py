"""``splitserve.sampling``: the top-k-first sampler draws from exactly the distribution that
transformers' own temperature, top-k and top-p processors define; decoding stops and pads."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.sampling import decode, next_tokens


def reference_distribution(logits: torch.Tensor, settings: GenerationConfig) -> torch.Tensor:
    """transformers' processors in generate's order (temperature, top-k, top-p), then softmax."""
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(settings.temperature)(None, scores)
    if settings.top_k > 0:
        scores = TopKLogitsWarper(settings.top_k)(None, scores)
    if settings.top_p < 1.0:
        scores = TopPLogitsWarper(settings.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, 5, 0.8), (1.0, 0, 0.9), (1.3, 4, 1.0), (0.5, 0, 1.0)],
)
def test_samples_follow_the_transformers_distribution(temperature, top_k, top_p):
    vocab, draws = 12, 60_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    settings = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = reference_distribution(logits, settings)
    tokens = next_tokens(logits.expand(draws, vocab), settings, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=vocab).double()
    # nothing outside the support, and every frequency within 5 standard errors
    assert counts[expected == 0].sum() == 0
    freq = counts / draws
    sigma = (expected.double() * (1 - expected.double()) / draws).sqrt()
    assert torch.all((freq - expected.double()).abs() <= 5 * sigma + 1e-12), (freq, expected)


def test_temperature_zero_is_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(next_tokens(logits, GenerationConfig(temperature=0.0), None), logits.argmax(-1))


def test_a_seeded_generator_repeats_its_draws():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    settings = GenerationConfig(temperature=1.0, top_k=10, top_p=0.9)
    first = next_tokens(logits, settings, torch.Generator().manual_seed(7))
    assert torch.equal(first, next_tokens(logits, settings, torch.Generator().manual_seed(7)))
    # and it is that generator's stream which is drawn from: other seeds give other draws, and
    # the generator moves on (a sampler that ignored it would repeat one fixed draw forever)
    others = [next_tokens(logits, settings, torch.Generator().manual_seed(seed)) for seed in range(8, 14)]
    assert any(not torch.equal(first, other) for other in others)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(next_tokens(logits, settings, generator), first)
    draws = [next_tokens(logits, settings, generator) for _ in range(6)]
    assert any(not torch.equal(first, draw) for draw in draws)


class ScriptedModel(torch.nn.Module):
    """Emits a fixed token sequence per row (as one-hot logits) and records its inputs."""

    def __init__(self, scripts: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.scripts, self.vocab, self.calls = scripts, vocab, []

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None,
                logits_to_keep=0):
        step = len(self.calls)
        self.calls.append((input_ids.clone(), attention_mask.clone(), position_ids.clone()))
        logits = torch.full((len(self.scripts), 1, self.vocab), -1e9)
        for row, script in enumerate(self.scripts):
            logits[row, 0, script[min(step, len(script) - 1)]] = 0.0
        return type("Out", (), {"past_key_values": ("cache", step), "logits": logits})()


def test_decode_pads_finished_rows_stops_when_all_end_and_tracks_positions():
    eos, pad = 1, 0
    model = ScriptedModel([[5, 6, eos, 9, 9], [7, eos, 9, 9, 9]], vocab=10)
    input_ids = torch.tensor([[0, 3, 4], [2, 3, 4]])
    attention_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 is left-padded
    out = decode(model, input_ids, attention_mask, GenerationConfig(temperature=0.0, max_new_tokens=8),
                 eos_ids=[eos], pad_id=pad, generator=None)
    assert out.tolist() == [[5, 6, eos], [7, eos, pad]]
    assert len(model.calls) == 3  # the prompt, then one call per new token except the last
    prefill_positions = model.calls[0][2]
    assert prefill_positions.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert model.calls[1][2].tolist() == [[2], [3]] and model.calls[2][2].tolist() == [[3], [4]]
    assert model.calls[2][1].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_decode_stops_at_max_new_tokens():
    model = ScriptedModel([[4]], vocab=6)
    out = decode(model, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long),
                 GenerationConfig(temperature=0.0, max_new_tokens=3), eos_ids=[5], pad_id=0,
                 generator=None)
    assert out.tolist() == [[4, 4, 4]] and len(model.calls) == 3


class RowCache:
    """A KV cache stand-in that supports dropping rows, as transformers' DynamicCache does."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in indices.tolist()]


class CompactingModel(ScriptedModel):
    """Like ScriptedModel, with a RowCache: each call computes only the rows still in the cache."""

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None,
                logits_to_keep=0):
        cache = past_key_values or RowCache(list(range(len(self.scripts))))
        assert input_ids.shape[0] == len(cache.rows) == attention_mask.shape[0] == position_ids.shape[0]
        step = len(self.calls)
        self.calls.append((list(cache.rows), position_ids.clone()))
        logits = torch.full((len(cache.rows), 1, self.vocab), -1e9)
        for i, row in enumerate(cache.rows):
            script = self.scripts[row]
            logits[i, 0, script[min(step, len(script) - 1)]] = 0.0
        return type("Out", (), {"past_key_values": cache, "logits": logits})()


def test_rows_that_end_leave_the_batch():
    eos, pad = 1, 0
    model = CompactingModel([[5, eos], [6, 7, 8, eos], [9, 9, eos]], vocab=10)
    input_ids = torch.tensor([[2, 3], [0, 3], [2, 4]])
    attention_mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    out = decode(model, input_ids, attention_mask, GenerationConfig(temperature=0.0, max_new_tokens=9),
                 eos_ids=[eos], pad_id=pad, generator=None)
    assert out.tolist() == [[5, eos, pad, pad], [6, 7, 8, eos], [9, 9, eos, pad]]
    assert [rows for rows, _ in model.calls] == [[0, 1, 2], [0, 1, 2], [1, 2], [1]]
    # row 1 (left-padded) keeps its own positions after the others leave
    assert [positions.tolist() for _, positions in model.calls[1:]] == [[[2], [1], [2]], [[2], [3]], [[3]]]
