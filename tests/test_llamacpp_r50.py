"""Session 50: the llama.cpp check compares each round's drafted tokens, not only its counts."""

from __future__ import annotations

from test_llamacpp import STDERR

from draftforge.eval import llamacpp
from draftforge.eval.llamacpp_check import Replay, classify

# STDERR with the candidate lines a DSpark draft logs with -v (common/speculative.cpp): three
# candidates a slot, candidate 0 the drafted token; rounds of 3, 2 and 2 slots
CANDIDATES = {
    1: [(0, 11), (1, 12), (2, 13)],
    2: [(0, 21), (1, 22)],
    3: [(0, 31), (1, 32)],
}


def _with_candidates(stderr: str, rounds: dict) -> str:
    out, n = [], 0
    for line in stderr.splitlines():
        if "accepted" in line and "draft tokens" in line:
            n += 1
            for pos, token in rounds[n]:
                for k, other in ((0, token), (1, token + 1000), (2, token + 2000)):
                    out.append(f"0.00.800.000 D  - seq_id 0, draft candidate {k:3d}, pos {pos:3d}: "
                               f"{other:6d} (   0.500) 'x'")
        out.append(line)
    return "\n".join(out) + "\n"


def _run(rounds=CANDIDATES, log=((0, 3, 3725), (2, 2, 5367), (1, 2, 2))):
    stderr = _with_candidates(STDERR.replace("n_drafted = 24", "n_drafted = 7"), rounds)
    run = llamacpp.parse_run("\n\nPROMPT\nanswer\n\n\n\n\n", stderr, "PROMPT\n")
    run.round_log = list(log)
    return run


def test_parse_run_reads_each_rounds_drafted_tokens():
    assert _run().round_drafts == [[11, 12, 13], [21, 22], [31, 32]]
    # candidate lines that do not line up with the rounds (a slot out of order): not read
    assert _run({**CANDIDATES, 2: [(1, 22)]}).round_drafts == []
    # without candidate lines (an older log): nothing to compare
    assert llamacpp.parse_run("\n\nPROMPT\nanswer\n\n\n\n\n", STDERR, "PROMPT\n").round_drafts == []


def _ours(drafts, slot_margins):
    return Replay(prompt_tokens=41, predicted=0, drafted=0, accepted=0, tokens=[],
                  round_log=[(0, 3, 3725), (2, 2, 5367), (1, 2, 2)], round_drafts=drafts,
                  target_margins=[1.0] * 3, draft_margins=[1.0] * 3, draft_slot_margins=slot_margins)


def test_classify_compares_the_drafted_tokens_of_rounds_that_agree():
    """Rounds were compared by their counts and last token only: a draft that proposed other
    tokens after its first rejected slot, or other rejected tokens, agreed all the same."""
    theirs = _run()
    wide = [[1.0] * 3, [1.0] * 2, [1.0] * 2]
    assert classify(theirs, _ours([[11, 12, 13], [21, 22], [31, 32]], wide),
                    tie_tolerance=0.01, same_text=True) == ("agree", "")
    status, detail = classify(theirs, _ours([[11, 12, 99], [21, 22], [31, 32]], wide),
                              tie_tolerance=0.01, same_text=True)
    assert status == "differ"
    assert detail.startswith("round 1 of 3, slot 2: llama.cpp drafted 13, draftforge 99 (same accepted run "
                             "and target token); draft margin 1")
    # at a slot where draftforge's draft had two choices within the tolerance: a near-tie
    close = [[1.0, 1.0, 0.004], [1.0] * 2, [1.0] * 2]
    assert classify(theirs, _ours([[11, 12, 99], [21, 22], [31, 32]], close),
                    tie_tolerance=0.01, same_text=True) == (
        "near-tie", "round 1 of 3, slot 2: llama.cpp drafted 13, draftforge 99 (same accepted run and "
        "target token): the draft's top two logits are 0.004 apart")
    # slots llama.cpp drafted past the verified ones (cut by the token budget) are not compared
    assert classify(theirs, _ours([[11, 12], [21, 22], [31, 32]], wide), tie_tolerance=0.01,
                    same_text=True)[0] == "agree"
