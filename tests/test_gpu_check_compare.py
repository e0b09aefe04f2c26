"""The comparisons behind ``make gpu-check``'s checks 1 and 4, on the CPU.

Check 1 compares per-token relative errors (SmolLM2's huge first-token activations
would dominate an error pooled over all positions); the integration tests stand in
transformers bf16 for SGLang against transformers float32 on check 1's prompts. Check 4
refuses a draft that accepts too little to tell anything, and catches a step counted
differently on requests whose outputs agree.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftforge.splitserve import gpu_check as G
from draftforge.splitserve import gpu_check_serving as S

# --------------------------------------------------------------------------- check 1


def test_relative_error_is_the_mean_of_per_token_errors():
    want = torch.tensor([[1000.0, 0.0], [3.0, 4.0], [0.0, 2.0]])
    got = torch.tensor([[1001.0, 0.0], [3.0, 4.5], [0.0, 2.0]])
    # by hand: 1/1000, 0.5/5, 0/2; pooled it would be sqrt(1.25)/sqrt(1000**2 + 29) ~ 0.0011
    assert G.relative_error(got, want) == pytest.approx((0.001 + 0.1 + 0.0) / 3)
    assert G.relative_error(torch.zeros(2, 3), torch.zeros(2, 3)) == 0.0
    assert G.relative_error(torch.ones(1, 3), torch.zeros(1, 3)) == math.inf
    assert G.relative_error(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0


def test_an_error_on_ordinary_tokens_is_not_hidden_by_one_huge_token():
    """One position 1000x the others' norm (as SmolLM2's first token): a 20 % error on every
    other position is a 20 % per-token error, not the ~0.001 % a pooled norm would give."""
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(10, 16, generator=gen)
    want[0] *= 1000.0
    got = want.clone()
    noise = torch.randn(9, 16, generator=gen)
    got[1:] += 0.2 * noise * want[1:].norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True)
    assert G.relative_error(got, want) == pytest.approx(0.2 * 9 / 10)


@pytest.fixture(scope="module")
def smollm2_features():
    """transformers float32 (layers 0-2, 13-15, 26-28) and bf16 (1, 14, 27) on check 1's prompts."""
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import load_tokenizer

    folder = str(smollm2.ensure_smollm2())
    cfg32 = TargetConfig(model=folder, backend="hf", dtype="float32")
    ids, mask = G.prompt_batch(load_tokenizer(cfg32), G.PROMPTS)
    probe = [0, 1, 2, 13, 14, 15, 26, 27, 28]
    aux32, final32, hidden = G.features_once(cfg32, probe, ids, mask, "cpu")
    cfg16 = TargetConfig(model=folder, backend="hf", dtype="bfloat16")
    aux16, final16, _ = G.features_once(cfg16, list(G.LAYER_IDS), ids, mask, "cpu")
    layers = {layer: aux32[..., k * hidden:(k + 1) * hidden] for k, layer in enumerate(probe)}
    return layers, final32, aux16, final16, mask, hidden


@pytest.mark.integration
def test_bf16_smollm2_passes_check_one_with_margin(smollm2_features):
    layers, final32, aux16, final16, mask, _ = smollm2_features
    ids = list(G.LAYER_IDS)
    passed, figures, reason = G.compare_features(layers, final32, aux16, final16, ids, mask)
    assert passed, reason
    for layer in ids:  # measured: errors 0.005-0.019, neighbours >= 0.236 away
        assert figures[f"err_l{layer}"] < G.FEATURE_REL_TOL / 2
        assert figures[f"err_l{layer}"] * 5 * G.SHIFT_MARGIN < figures[f"next_l{layer}"]
    assert figures["err_final"] < G.FEATURE_REL_TOL / 2


@pytest.mark.integration
def test_a_smollm2_layer_shifted_by_one_fails_as_an_index_shift(smollm2_features):
    layers, final32, aux16, final16, mask, hidden = smollm2_features
    shifted = aux16.clone()
    shifted[..., hidden:2 * hidden] = layers[15].to(torch.bfloat16).float()  # 14 captured as 15
    passed, figures, reason = G.compare_features(layers, final32, shifted, final16,
                                                 list(G.LAYER_IDS), mask)
    assert not passed
    assert "layer 14 matches transformers' neighbouring layer" in reason and "index shift" in reason
    assert "layer 1 " not in reason and "layer 27" not in reason


# --------------------------------------------------------------------------- check 4


def _counts(pairs, outputs):
    return [S.SpecCounts(t, s, t / s, tuple(o)) for (t, s), o in zip(pairs, outputs, strict=True)]


OUTPUTS = [list(range(64)), list(range(100, 164)), list(range(200, 264))]


def test_compare_acceptance_refuses_a_draft_that_accepts_nothing():
    # tau ~1: SGLang 64 tokens in 64 steps against draftforge's 64 in 63 (the prefill token)
    sglang = _counts([(64, 64)] * 3, OUTPUTS)
    passed, figures, reason = S.compare_acceptance(sglang, [(64, 63)] * 3, OUTPUTS)
    assert not passed and reason.startswith("uninformative")
    assert figures["draftforge_tok_per_step"] == pytest.approx(64 / 63)
    assert figures["rel_diff"] < S.ACCEPT_REL_TOL  # what the pooled comparison alone passed


def test_compare_acceptance_catches_one_extra_step_per_request_at_tau_three():
    ours = [(64, 21), (64, 22), (64, 21)]
    slip = _counts([(t, s + 1) for t, s in ours], OUTPUTS)  # e.g. the prefill counted as a step
    passed, figures, reason = S.compare_acceptance(slip, ours, OUTPUTS)
    assert figures["rel_diff"] == pytest.approx(1 - 64 / 67)  # within the pooled 10 %
    assert not passed and "+1.00 verification steps per request" in reason
    assert figures["same_output_requests"] == 3 and figures["mean_step_diff"] == 1.0


def test_compare_acceptance_passes_matching_counts():
    ours = [(64, 21), (64, 22), (64, 21)]
    # one marginal draft token flipped on one request; the third request's text parted
    sglang = _counts([(64, 21), (64, 23), (64, 25)], [OUTPUTS[0], OUTPUTS[1], list(range(64))])
    passed, figures, reason = S.compare_acceptance(sglang, ours, OUTPUTS)
    assert passed, reason
    assert figures["same_output_requests"] == 2 and figures["mean_step_diff"] == 0.5
