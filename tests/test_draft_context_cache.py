"""The draft's context cache: keys and values kept across rounds, as a server keeps its draft KV.

Each test compares against the draft recomputing its whole context every block, which is the
training-side path (``block_forward`` without a cache, itself checked against the packed
training forward in test_draft_model.py).
"""

from __future__ import annotations

import pytest
import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval import speculative as spec
from draftforge.eval.speculative import DecodeSettings, TargetSession, speculative_decode
from draftforge.train.model import ContextCache


@pytest.fixture(scope="module")
def target():
    return tiny_target(sharpness=4.0)


@pytest.mark.parametrize("layers", [1, 3])
def test_blocks_over_a_growing_context_match_the_whole_context_recomputed(target, layers):
    """The context grows by 1 to 9 positions between blocks, as accepted tokens append it."""
    draft = tiny_eval_draft(target, num_hidden_layers=layers)
    generator = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 60, draft.config.num_context_features, generator=generator)
    tokens = torch.randint(0, draft.config.vocab_size, (60,), generator=generator)
    cache = ContextCache()
    anchor_pos, blocks = 5, 0
    with torch.no_grad():
        while anchor_pos < 60:
            anchor = tokens[anchor_pos : anchor_pos + 1]
            cached = draft.block_forward(anchor, anchor_pos, aux, cache=cache)
            whole = draft.block_forward(anchor, anchor_pos, aux[:, :anchor_pos])
            torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)
            assert cache.length == anchor_pos
            anchor_pos += 1 + blocks % 9
            blocks += 1
    assert blocks >= 10


def test_the_cache_projects_only_the_positions_it_does_not_hold(target):
    """Positions the cache holds are not read again: changing them changes nothing (all but
    the last held one, which the cache compares to tell another sequence's context apart)."""
    draft = tiny_eval_draft(target)
    aux = torch.randn(1, 20, draft.config.num_context_features, generator=torch.Generator().manual_seed(1))
    cache = ContextCache()
    anchor = torch.tensor([7])
    with torch.no_grad():
        draft.block_forward(anchor, 12, aux, cache=cache)
        changed = aux.clone()
        changed[:, :11] = 0.0
        again = draft.block_forward(anchor, 16, changed, cache=cache)
        whole = draft.block_forward(anchor, 16, aux[:, :16])
    torch.testing.assert_close(again, whole, rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_a_shorter_context_and_clear_starts_over(target):
    draft = tiny_eval_draft(target)
    aux = torch.randn(1, 20, draft.config.num_context_features)
    cache = ContextCache()
    with torch.no_grad():
        draft.block_forward(torch.tensor([7]), 12, aux, cache=cache)
        with pytest.raises(ValueError, match="holds 12 positions and the block asks for 8: a new sequence"):
            draft.block_forward(torch.tensor([7]), 8, aux, cache=cache)
        cache.clear()
        torch.testing.assert_close(draft.block_forward(torch.tensor([7]), 8, aux, cache=cache),
                                   draft.block_forward(torch.tensor([7]), 8, aux[:, :8]))


def test_a_cache_not_cleared_refuses_another_sequences_context(target):
    """A proposer reused without clearing its cache for a longer, different context would draft
    from the first sequence's keys and values; the cache refuses it instead."""
    draft = tiny_eval_draft(target)
    generator = torch.Generator().manual_seed(5)
    first = torch.randn(1, 20, draft.config.num_context_features, generator=generator)
    second = torch.randn(1, 30, draft.config.num_context_features, generator=generator)
    cache = ContextCache()
    with torch.no_grad():
        draft.block_forward(torch.tensor([7]), 12, first, cache=cache)
        with pytest.raises(ValueError, match=r"holds 12 positions of another context \(the features of position 11 differ\)"):
            draft.block_forward(torch.tensor([7]), 16, second, cache=cache)
        same_prefix = second.clone()
        same_prefix[:, :12] = first[:, :12]  # the same first 12 positions: the cache is valid
        torch.testing.assert_close(draft.block_forward(torch.tensor([7]), 16, same_prefix, cache=cache),
                                   draft.block_forward(torch.tensor([7]), 16, same_prefix[:, :16]),
                                   rtol=1e-5, atol=1e-5)


def test_the_same_context_with_a_nan_at_the_last_held_position_is_not_called_another(target):
    """NaN != NaN: the comparison takes a NaN where the cache projected one as the same value."""
    draft = tiny_eval_draft(target)
    aux = torch.randn(1, 20, draft.config.num_context_features, generator=torch.Generator().manual_seed(2))
    aux[0, 11, 0] = float("nan")
    cache = ContextCache()
    with torch.no_grad():
        draft.block_forward(torch.tensor([7]), 12, aux, cache=cache)
        draft.block_forward(torch.tensor([7]), 16, aux, cache=cache)
        assert cache.length == 16
        other = aux.clone()
        other[0, 15, 1] += 1.0
        with pytest.raises(ValueError, match="holds 16 positions of another context"):
            draft.block_forward(torch.tensor([7]), 18, other, cache=cache)


class Recomputing(spec.DraftProposer):
    """The draft proposer without the cache: every block projects the whole context again."""

    def propose(self, sequence, features):
        self.cache.clear()
        return super().propose(sequence, features)


def test_one_proposer_decodes_prompt_after_prompt_as_the_uncached_draft_does(target):
    """speculative_decode starts each prompt with a clear cache: the same proposer object over
    three prompts gives the rounds of a proposer that recomputes every block."""
    draft = tiny_eval_draft(target, num_hidden_layers=2)
    settings = DecodeSettings(max_new_tokens=24)
    cached = spec.DraftProposer(draft, temperature=0.0, generator=torch.Generator())
    uncached = Recomputing(draft, temperature=0.0, generator=torch.Generator())
    session = TargetSession(target.model, draft.config.target_layer_ids)
    for prompt in random_prompts(3, seed=11):
        got = speculative_decode(session, prompt, cached, settings)
        want = speculative_decode(session, prompt, uncached, settings)
        assert got.tokens == want.tokens
        assert [r.num_accepted for r in got.rounds] == [r.num_accepted for r in want.rounds]
        assert len(got.rounds) > 3
