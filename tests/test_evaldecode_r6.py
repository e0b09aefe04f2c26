"""Review round 6 of the speculative-decoding verifier."""

from __future__ import annotations

import pytest
import torch
import transformers

from draftforge.eval.baselines import NoDraft
from draftforge.eval.speculative import (
    DecodeSettings,
    Proposal,
    Proposer,
    TargetSession,
    check_lossless,
    speculative_decode,
)

VOCAB = 64
LAYERS = [0, 1, 3]


def _sliding_window_target():
    """Mistral with a 6-token window in every layer: the cache keeps 5 past tokens a layer."""
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.MistralForCausalLM(cfg)


def _hybrid_target():
    """Ling-3.0-Flash's architecture (bailing_hybrid) in small: linear-attention (KDA) layers,
    whose cache is a short convolution state and one recurrent state, and MLA layers."""
    cfg = transformers.BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=6,
        layer_group_size=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        num_local_experts=4, first_k_dense_replace=1, num_mtp_layers=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg)


class CutOracle(Proposer):
    """Feature-hungry like the draft: records the features each round hands it and proposes the
    reference continuation cut after 0, 1, .. gamma tokens in turn, wrong after the cut, so
    that rounds accept anything from nothing to the whole block and roll the rest back."""

    name, needs_features = "cut-oracle", True

    def __init__(self, reference, gamma):
        self.reference, self.gamma, self.calls = reference, gamma, []

    def propose(self, sequence, features):
        cut = len(self.calls) % (self.gamma + 1)
        self.calls.append((len(sequence), features.clone()))
        cont = self.reference[len(sequence) : len(sequence) + self.gamma]
        return Proposal(tokens=cont[:cut] + [(t + 1) % VOCAB for t in cont[cut:]])


@pytest.mark.parametrize("build", [_sliding_window_target, _hybrid_target])
def test_rejected_drafts_roll_back_on_sliding_window_and_linear_attention_targets(build):
    """transformers' sliding-window and linear-attention cache layers keep only what the next
    token needs, and their crop refused to roll a rejected draft back (a RuntimeError at the
    first rejection: every evaluation against Ling-3.0-Flash stopped there). Rolled back, the
    output is plain greedy decoding's and every round's features are a cache-free forward's."""
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 3.0)  # no near-ties among the random logits
    prompt = [5, 9, 3, 7, 2, 8, 4, 6, 11, 12, 13, 17]  # longer than the window
    plain = speculative_decode(TargetSession(model, None), prompt, NoDraft(), DecodeSettings(max_new_tokens=24))
    full = prompt + plain.tokens
    oracle = CutOracle(full, gamma=4)
    session = TargetSession(model, LAYERS)
    result = speculative_decode(session, prompt, oracle, DecodeSettings(max_new_tokens=24))
    assert check_lossless(result, plain, tie_tolerance=0.0) == 0
    assert [r.num_accepted for r in result.rounds][:5] == [0, 1, 2, 3, 4]  # rollbacks of every size
    _, aux = TargetSession(model, LAYERS).prefill(full)
    for length, features in oracle.calls:
        torch.testing.assert_close(features, aux[: length - 1], rtol=1e-4, atol=1e-5)
    # what the cache kept for a rollback is trimmed again: the windows stay 5 tokens long
    if build is _sliding_window_target:
        assert {layer.keys.shape[-2] for layer in session.cache.layers} == {5}


def test_the_prefill_runs_the_lm_head_on_the_last_prompt_token_only():
    """Only the last prompt token's logits are used; the prefill computed (and copied to float32)
    [L, V] logits: 5 GB for an 8K-token prompt over Ling's 157,184 tokens."""
    from eval_helpers import random_prompts, tiny_target

    target = tiny_target()
    prompt = random_prompts(1)[0]
    rows = []
    handle = target.model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[1]))
    try:
        logits, aux = TargetSession(target.model, LAYERS[:2]).prefill(prompt)
    finally:
        handle.remove()
    assert rows == [1] and logits.shape == (1, target.model.config.vocab_size)
    assert aux.shape[0] == len(prompt)  # the features still cover every prompt token
    with torch.no_grad():
        full = target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], full, rtol=1e-5, atol=1e-5)
