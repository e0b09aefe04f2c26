"""Review round 9 of the speculative-decoding evaluator: what the lossless check excuses as a near-tie."""

from __future__ import annotations

import pytest
import torch

from draftforge.eval.baselines import NoDraft
from draftforge.eval.speculative import (
    DecodeResult,
    DecodeSettings,
    LosslessCheckError,
    check_lossless,
    speculative_decode,
)

PROMPT = [0, 5]
# next-token logits by position (the stub ignores the tokens): output j comes from row
# len(PROMPT) - 1 + j. Output 1 is a near-tie: token 1 at 5.0, token 2 at 4.9995, token 3
# at 4.9993 (a three-way tie within 1e-3), token 4 far below at -3.
ROWS = [
    [9.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
    [0.0, 5.0, 4.9995, 4.9993, -3.0, 0.0],
    [0.0, 0.0, 0.0, 9.0, 0.0, 0.0],
    [0.0, 0.0, 9.0, 0.0, 0.0, 0.0],
    [9.0, 0.0, 0.0, 0.0, 0.0, 0.0],
]


class PositionTarget:
    """A target with a KV cache whose logits depend on the position alone."""

    def __init__(self) -> None:
        self.table = torch.tensor(ROWS, dtype=torch.float32)
        self.length = 0

    def prefill(self, token_ids):
        self.length = 0
        return self.extend(token_ids)

    def extend(self, token_ids):
        start, self.length = self.length, self.length + len(token_ids)
        return self.table[start : self.length], None

    def crop(self, length: int) -> None:
        self.length = length


def _plain() -> DecodeResult:
    return speculative_decode(PositionTarget(), PROMPT, NoDraft(), DecodeSettings(max_new_tokens=4))


def _least_likely_bonus(drafts, target_logits):
    """A broken verifier: rejects every draft and emits the target's least likely token."""
    return 0, int(target_logits[0].argmin())


def test_a_wrong_token_at_a_near_tie_is_not_excused_as_one():
    """The near-tie excuse is for a token the reference nearly chose: a verifier that emits
    the reference's least likely token where its top two tie passed the check (counted as a
    near-tie, comparison stopped), so a broken verifier went unnoticed on such prompts."""
    reference = _plain()
    assert reference.tokens == [5, 1, 3, 2]
    assert reference.top2_margins[1] == pytest.approx(5e-4, abs=1e-4)
    broken = speculative_decode(PositionTarget(), PROMPT, NoDraft(), DecodeSettings(max_new_tokens=4),
                                accept_greedy=_least_likely_bonus)  # fmt: skip
    assert broken.tokens[:2] == [5, 4]  # the least likely token where the reference nearly tied
    with pytest.raises(LosslessCheckError, match=r"output token 1 is 4 but plain greedy decoding gives 1 "
                                                 r"\(reference top-2 logit margin there: 0\.000"):
        check_lossless(broken, reference, tie_tolerance=1e-3)


@pytest.mark.parametrize("swapped_in", [2, 3])
def test_a_token_within_the_tolerance_of_the_references_choice_is_a_near_tie(swapped_in):
    """The runner-up and, in a three-way tie, the third token both lie within 1e-3 of the top."""
    reference = _plain()
    speculative = DecodeResult(prompt_len=len(PROMPT), tokens=[5, swapped_in, 0, 0])
    assert check_lossless(speculative, reference, tie_tolerance=1e-3) == 1
    with pytest.raises(LosslessCheckError, match=f"output token 1 is {swapped_in} but"):
        check_lossless(speculative, reference, tie_tolerance=4e-4)  # tokens 2 and 3 lie 5e-4 and 7e-4 below


def test_a_token_beyond_the_recorded_candidates_is_never_excused():
    """Plain decoding keeps the distances of its 8 most likely tokens; how far below one further
    down lies is not known, so it is never a near-tie, even where all 8 tie."""
    reference = DecodeResult(prompt_len=1, tokens=[7], top2_margins=[1e-4],
                             top_gaps=[{7: 0.0, 1: 1e-4} | {t: 0.5 for t in range(10, 16)}])  # fmt: skip
    outside = DecodeResult(prompt_len=1, tokens=[99])
    with pytest.raises(LosslessCheckError, match="output token 0 is 99"):
        check_lossless(outside, reference, tie_tolerance=0.1)
    with pytest.raises(LosslessCheckError, match="output token 0 is 99"):
        check_lossless(outside, reference, tie_tolerance=1.0)
    assert check_lossless(DecodeResult(prompt_len=1, tokens=[12]), reference, tie_tolerance=1.0) == 1
