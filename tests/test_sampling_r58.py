"""Session 58: a temperature so small that ``logits / temperature`` overflows.

At 1e-40 a logit of 30 divides to +inf (float32), and the softmax of a row holding +inf is NaN:
the regenerating sampler drew from NaN and the evaluator failed inside torch. The limit of the
distribution as the temperature falls is the greedy choice (shared among exact ties), which is
what both now give; above the overflow the quotient is the plain one, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from draftforge.eval.speculative import sampling_probs
from draftforge.splitserve.sampling import scaled_logits, top_k_top_p


def _rows():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=generator) * 12
    logits[2] = -logits[2].abs() - 40  # every logit of a row far below zero: all overflow to -inf
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1  # an exact tie at the top
    return logits


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-38, 1e-46, 1e-300, 5e-324])  # the last 3: 0 in float32
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.8), (20, 0.8)])
def test_a_vanishing_temperature_gives_the_greedy_distribution(temperature, top_k, top_p):
    logits = _rows()
    assert not bool(torch.isfinite((logits / temperature).amax(dim=-1)).all())  # the case overflows
    probs = sampling_probs(logits, temperature, top_k, top_p)
    assert bool(torch.isfinite(probs).all())
    expected = torch.zeros_like(probs)
    for row in range(3):
        expected[row, int(logits[row].argmax())] = 1.0
    torch.testing.assert_close(probs[:3], expected[:3], rtol=0, atol=1e-6)
    # the tied pair shares the mass; at top-p 0.8 the nucleus keeps both (1/2 before the second)
    assert probs[3, [7, 11]].tolist() == [0.5, 0.5]
    assert float(probs[3].sum() - probs[3, [7, 11]].sum()) == 0.0


def test_the_sampler_draws_the_argmax_at_a_vanishing_temperature():
    logits = _rows()[:3]
    probs, indices = top_k_top_p(logits, 1e-40, 20, 0.8)
    generator = torch.Generator().manual_seed(0)
    drawn = indices.gather(-1, torch.multinomial(probs, 1, generator=generator)).squeeze(-1)
    assert drawn.tolist() == logits.argmax(dim=-1).tolist()


def test_an_ordinary_temperature_keeps_the_plain_quotient_bit_for_bit():
    logits = _rows()
    logits[0, 5] = -torch.inf  # a masked token: the row's maximum is still finite
    for temperature in (0.7, 1e-3, 2.0):
        assert torch.equal(scaled_logits(logits, temperature), logits / temperature)
