"""The evaluator's prefill on a target whose forward lacks ``logits_to_keep``, and sampled
drafts' distributions kept as they were drawn (a review of eval/, 2026-12-06)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.eval import speculative as spec
from draftforge.eval.baselines import NgramProposer, NoDraft
from draftforge.eval.speculative import DecodeSettings, TargetSession, speculative_decode


class _OlderForward(torch.nn.Module):
    """A causal LM whose forward names its arguments and has no ``logits_to_keep`` (remote
    code written before transformers added it, as DeepSeek-V2's): anything else raises."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def get_decoder(self):
        return self.inner.get_decoder()

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=past_key_values, use_cache=use_cache)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)


def _greedy_by_hand(model, prompt: list[int], count: int) -> list[int]:
    """Greedy tokens by full forward passes, no cache: the independent reference."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            sequence.append(int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt):]


def test_an_older_forward_prefills_and_decodes_losslessly():
    """``TargetSession.prefill`` passed ``logits_to_keep=1`` to every target, so one whose
    forward lacks it raised a TypeError at the first prompt of ``draftforge eval`` (the
    regeneration sampler had been fixed for it). It now asks as the sampler does: the logits
    of the last token [1, V] and the features of every prompt token, equal to the model's own,
    and greedy decoding with no draft and with n-gram lookup gives the model's greedy tokens."""
    target = tiny_target()
    older = _OlderForward(target.model).eval()
    prompt = random_prompts(1, length=12, seed=5)[0]
    layers = [0, 2]
    logits, aux = TargetSession(older, layers).prefill(prompt)
    plain_logits, plain_aux = TargetSession(target.model, layers).prefill(prompt)
    assert logits.shape == (1, target.model.config.vocab_size)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert aux.shape[0] == len(prompt)
    torch.testing.assert_close(aux, plain_aux, rtol=1e-5, atol=1e-6)

    expected = _greedy_by_hand(target.model, prompt, 16)
    settings = DecodeSettings(max_new_tokens=16)
    for proposer in (NoDraft(), NgramProposer(4)):
        result = speculative_decode(TargetSession(older, layers), prompt, proposer, settings)
        assert result.tokens == expected, proposer.name


def test_sampled_drafts_carry_the_very_distributions_they_were_drawn_from(monkeypatch):
    """Rejection sampling divides by the distribution each draft token was drawn from. The
    proposer drew each slot from one computation and returned a second, made again on all
    slots at once: equal only where the batched and the one-row kernels agree bit for bit
    (top-k ties and top-p's boundary can differ on a GPU). A stand-in that answers every call
    differently (a point mass on a token that moves with each call) tells the two apart: each
    returned row must be the one its token was drawn from."""
    target = tiny_target()
    draft = tiny_eval_draft(target)
    calls = []

    def moving_point_mass(logits, temperature, top_k=0, top_p=1.0):
        calls.append(logits.shape[0])
        probs = torch.zeros(logits.shape)
        probs[:, 20 + len(calls)] = 1.0
        return probs

    monkeypatch.setattr(spec, "sampling_probs", moving_point_mass)
    prompt = random_prompts(1, seed=21)[0]
    _, aux = TargetSession(target.model, draft.config.target_layer_ids).prefill(prompt)
    proposer = spec.DraftProposer(draft, temperature=0.7, generator=torch.Generator().manual_seed(4),
                                  draft_sampling="sample")
    proposal = proposer.propose(prompt, aux[:-1])
    block = draft.config.block_size
    assert proposal.tokens == [21 + k for k in range(block)]  # one draw per slot, in order
    assert calls == [1] * block  # and no second computation
    for k, token in enumerate(proposal.tokens):
        assert proposal.probs[k, token] == 1.0
