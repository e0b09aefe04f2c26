"""``draftforge eval llamacpp``: a near-tie is read where the two sides part (review round 35).

llama.cpp drafts a block, cut before the first slot whose confidence is below p_min
(common/speculative.cpp lines 1267-1277), and its target then accepts the longest prefix it
agrees with (common/sampling.cpp ``common_sampler_sample_and_accept_n``, lines 687-698). So in a
round both sides accepted, one after the other, the drafts before the position where they part,
and both kept the slots before the one where the shorter block was cut: a close choice at an
earlier position (on which both sides chose alike) cannot explain a difference later in the
round, and must not excuse it as a float32 near-tie.
"""

from __future__ import annotations

from test_llamacpp_r27 import (  # stand-ins: the same block every round; a scripted target
    _Draft,
    _Target,
)

from draftforge.eval import llamacpp
from draftforge.eval.llamacpp_check import classify, replay

END = 0
PROMPT = [1, 2, 3]
ANSWER = [4, 5, 6, END, 8, 9, 10, 11]  # the end of turn after 6: one round


def _theirs(rounds, prompt_tokens=3):  # len(PROMPT)
    """llama-speculative-simple's log (stderr, as in tests/test_llamacpp_r27.py) for these rounds."""
    lines = [f"0.00.849.128 D accepted {a}/{d} draft tokens, the last target token is: ({t})" for a, d, t in rounds]
    accepted, drafted = sum(r[0] for r in rounds), sum(r[1] for r in rounds)
    lines += [
        f"0.08.269.938 I encoded {prompt_tokens:4d} tokens in    0.179 seconds, speed:  229.330 t/s",
        f"0.08.269.940 I n_predict = {accepted + len(rounds)}",
        f"0.08.269.940 I n_drafted = {drafted}",
        f"0.08.269.940 I n_accept  = {accepted}",
    ]
    return llamacpp.parse_run("\n\nP\n\n\n\n", "\n".join(lines) + "\n", "P")


def test_a_close_target_choice_before_the_rounds_part_does_not_excuse_a_difference():
    """draftforge accepts 3 of [4, 5, 6, 9] (the target wants the end of turn after 6, by a clear margin of 1);
    llama.cpp accepts all 4: its target took 9 where draftforge's was far from it, a real
    difference. The target's one close choice (0.004) is at position 0, where both accepted 4."""
    target = _Target(PROMPT + ANSWER, margins={len(PROMPT) - 1: 0.004})
    ours = replay(target, _Draft([4, 5, 6, 9]), PROMPT, max_new_tokens=16, eos={END})
    assert ours.round_log == [(3, 4, END)]
    status, detail = classify(_theirs([(4, 4, 10)]), ours, tie_tolerance=0.01, same_text=False)
    assert status == "differ" and detail.startswith("round 1 of 1: llama.cpp (4, 4, 10) against draftforge (3, 4, 0)")
    # the same close choice where the two part (position 3: the end of turn or 9) is a near-tie
    close = _Target(PROMPT + ANSWER, margins={len(PROMPT) + 2: 0.004})
    ours = replay(close, _Draft([4, 5, 6, 9]), PROMPT, max_new_tokens=16, eos={END})
    assert classify(_theirs([(4, 4, 10)]), ours, tie_tolerance=0.01, same_text=False) == (
        "near-tie", "round 1 of 1: the target's top two logits are 0.004 apart")
    # ... and so is a close draft choice at that slot
    ours = replay(_Target(PROMPT + ANSWER), _Draft([4, 5, 6, 9], margins=[1.0, 1.0, 1.0, 0.004]), PROMPT,
                  max_new_tokens=16, eos={END})  # fmt: skip
    assert classify(_theirs([(4, 4, 10)]), ours, tie_tolerance=0.01, same_text=False)[0] == "near-tie"
    # a close draft choice at a slot both accepted does not explain it either
    ours = replay(_Target(PROMPT + ANSWER), _Draft([4, 5, 6, 9], margins=[0.004, 1.0, 1.0, 1.0]), PROMPT,
                  max_new_tokens=16, eos={END})  # fmt: skip
    assert classify(_theirs([(4, 4, 10)]), ours, tie_tolerance=0.01, same_text=False)[0] == "differ"


def test_a_confidence_close_to_the_cut_at_a_slot_both_kept_does_not_excuse_a_different_cut():
    """With p_min 0.5 (logit 0), draftforge's block [4, 5, 6, 9] is cut before slot 3 (logit -3):
    3 drafts. llama.cpp drafted 2: it cut before slot 2, whose confidence logit draftforge puts 3
    above the cut, a real difference. Slot 0's logit lies 0.005 above the cut, but both kept it."""
    draft = _Draft([4, 5, 6, 9], confidence_logits=[0.005, 3.0, 3.0, -3.0])
    ours = replay(_Target(PROMPT + ANSWER), draft, PROMPT, max_new_tokens=16, eos={END}, p_min=0.5)
    assert ours.round_log == [(3, 3, END)]
    status, detail = classify(_theirs([(2, 2, 6)]), ours, tie_tolerance=0.01, same_text=False)
    assert status == "differ" and detail.startswith("round 1 of 1: llama.cpp (2, 2, 6) against draftforge (3, 3, 0)")
    # close to the cut at slot 2, where llama.cpp cut: a near-tie
    draft = _Draft([4, 5, 6, 9], confidence_logits=[3.0, 3.0, 0.005, -3.0])
    ours = replay(_Target(PROMPT + ANSWER), draft, PROMPT, max_new_tokens=16, eos={END}, p_min=0.5)
    assert classify(_theirs([(2, 2, 6)]), ours, tie_tolerance=0.01, same_text=False) == (
        "near-tie", "round 1 of 1: a confidence logit lies 0.005 from the --p-min cut")
    # llama.cpp drafting more (the whole block) where draftforge cut at slot 3 by a clear 3: no
    # near-tie either, however close slot 0 lay
    draft = _Draft([4, 5, 6, 9], confidence_logits=[0.005, 3.0, 3.0, -3.0])
    ours = replay(_Target(PROMPT + ANSWER), draft, PROMPT, max_new_tokens=16, eos={END}, p_min=0.5)
    assert classify(_theirs([(4, 4, 10)]), ours, tie_tolerance=0.01, same_text=False)[0] == "differ"
