"""``draftforge eval llamacpp`` against the llama.cpp source it pins (llama-cpp-python 0.3.36's).

- :func:`replay` counts a round that drafts the end of turn as llama.cpp does;
- :func:`classify` calls a difference a near-tie only where the close choice could have made it.
"""

from __future__ import annotations

import pytest
import torch
from test_llamacpp import _built_tools, _greedy_reference, memorised_export

from draftforge.eval import llamacpp
from draftforge.eval.llamacpp_check import Replay, classify, replay
from draftforge.eval.speculative import Proposal

END = 0


class _Target:
    """A stand-in TargetSession whose greedy choice after position p is ``reference[p + 1]``,
    whatever was fed, by ``margins[p]`` (default 1) over the runner-up token 15; no features."""

    def __init__(self, reference: list[int], margins: dict[int, float] | None = None, vocab: int = 16):
        self.reference, self.margins, self.vocab, self.length = reference, margins or {}, vocab, 0

    def prefill(self, tokens):
        self.length = len(tokens)
        return None, torch.zeros(len(tokens), 1)

    def extend(self, tokens):
        start, self.length = self.length, self.length + len(tokens)
        logits = torch.zeros(len(tokens), self.vocab)
        for row in range(len(tokens)):
            logits[row, 15] = 1.0 - self.margins.get(start + row, 1.0)
            logits[row, self.reference[start + row + 1]] = 1.0
        return logits, torch.zeros(len(tokens), 1)

    def crop(self, length):
        self.length = length


class _Draft:
    """A stand-in DraftProposer proposing the same block every round."""

    def __init__(self, tokens, confidence_logits=None, margins=None):
        self.proposal = Proposal(tokens=tokens, confidence_logits=confidence_logits,
                                 margins=margins or [1.0] * len(tokens))  # fmt: skip

    def start(self):
        pass

    def propose(self, sequence, features):
        return self.proposal


def test_an_end_of_turn_draft_ends_the_round_as_llamacpp_accepts_it():
    """llama.cpp's ``common_sampler_sample_and_accept_n`` (common/sampling.cpp, lines 687-698)
    breaks after a draft the target agrees with when it is an EOG token and not the block's
    last (``draft[i] != id || (llama_vocab_is_eog(vocab, id) && i + 1 < draft.size())``), and
    samples no token after it; examples/speculative-simple/speculative-simple.cpp then counts
    ``n_accept += ids.size() - 1``, ``n_predict += ids.size()`` (lines 296-297) and logs
    ``accepted %d/%d draft tokens, the last target token is: (%d)`` with the EOG token last
    (line 323). Here the target would also take the two drafts after the end of turn."""
    prompt = [1, 2, 3]
    target = _Target(prompt + [4, END, 5, 6, 7])
    run = replay(target, _Draft([4, END, 5, 9]), prompt, max_new_tokens=16, eos={END})
    assert run.round_log == [(1, 4, END)]  # llama.cpp: accepted 1/4 draft tokens, ... (0)
    assert (run.predicted, run.drafted, run.accepted, run.tokens) == (2, 4, 1, [4, END])
    # an end of turn in the block's last slot is accepted and the target's token follows it
    last = replay(_Target(prompt + [4, 5, END, 6]), _Draft([4, 5, END]), prompt, max_new_tokens=16, eos={END})
    assert last.round_log == [(3, 3, END)] and (last.predicted, last.accepted) == (4, 3)


# llama-speculative-simple's log (stderr) for three rounds: the per-round line of
# examples/speculative-simple/speculative-simple.cpp line 323 (LOG_DBG, shown with -v) and the
# totals of lines 349 and 354-356 (LOG_INF), each behind the timestamp and level letter that
# common_init turns on (common/common.cpp lines 390-391, printed by common/log.cpp lines 138-156)
STDERR = """0.00.849.128 D accepted 0/8 draft tokens, the last target token is: (3725)
0.00.917.421 D accepted 2/8 draft tokens, the last target token is: (5367)
0.00.985.614 D accepted 1/8 draft tokens, the last target token is: (2)
0.08.269.938 I encoded   41 tokens in    0.179 seconds, speed:  229.330 t/s
0.08.269.940 I n_draft   = 8
0.08.269.940 I n_predict = 6
0.08.269.940 I n_drafted = 24
0.08.269.940 I n_accept  = 3
"""


def _ours(log, target=1.0, draft=1.0, confidence=1.0) -> Replay:
    """draftforge's side with the given round log and, in round 2, the given margins."""
    return Replay(prompt_tokens=41, predicted=0, drafted=0, accepted=0, tokens=[], round_log=log,
                  target_margins=[1.0, target, 1.0], draft_margins=[1.0, draft, 1.0],
                  confidence_margins=[1.0, confidence, 1.0])  # fmt: skip


def test_a_near_tie_counts_only_where_it_could_have_made_the_difference():
    """llama.cpp drafts a block (common/speculative.cpp, ``draft``: cut at the first slot whose
    confidence is below p_min, lines 1267-1277) before the target sees it
    (speculative-simple.cpp lines 196 and 232-257). A target near-tie cannot change how many
    tokens a round drafted; a confidence logit near the cut cannot change a round that drafted as
    many (the same cut), however close it lies."""
    theirs = llamacpp.parse_run("\n\nP\n\n\n\n", STDERR, "P")
    # round 2 drafted 5 tokens here, 8 there: a close target choice does not explain it
    fewer = [(0, 8, 3725), (2, 5, 5367), (1, 8, 2)]
    status, detail = classify(theirs, _ours(fewer, target=0.004), tie_tolerance=0.01, same_text=True)
    assert status == "differ" and detail.startswith("round 2 of 3: llama.cpp (2, 8, 5367) against draftforge (2, 5, 5367)")
    assert classify(theirs, _ours(fewer, confidence=0.004), tie_tolerance=0.01, same_text=True)[0] == "near-tie"
    # round 2 drafted 8 on both sides but accepted differently: a confidence near the cut does not explain it
    other = [(0, 8, 3725), (3, 8, 77), (0, 8, 2)]
    status, detail = classify(theirs, _ours(other, confidence=2e-5), tie_tolerance=0.01, same_text=False)
    assert status == "differ" and "llama.cpp (2, 8, 5367) against draftforge (3, 8, 77)" in detail
    assert classify(theirs, _ours(other, draft=0.004), tie_tolerance=0.01, same_text=False)[0] == "near-tie"


def test_a_close_draft_choice_feeding_the_confidence_cut_is_a_near_tie():
    """In llama.cpp's DSpark graph the confidence of slot i reads the Markov head's row of the
    token chosen at slot i-1 (src/models/dflash.cpp lines 350-385: ``w1_prev = ggml_get_rows(w1,
    prev)`` into ``feat``, then ``prev = ggml_argmax(ctx0, col)``), and the block is cut before the
    first slot whose confidence is below p_min (common/speculative.cpp lines 1275-1277). So a
    close draft choice after the first rejected slot can move the cut: here slot 1 (0.004 between
    its top two) feeds the confidence of slot 2, which cut draftforge's block after 2 drafts and
    llama.cpp's after 3."""
    prompt = [1, 2, 3]
    draft = _Draft([9, 9, 9, 9], confidence_logits=[3.0, 3.0, -3.0, 3.0], margins=[1.0, 0.004, 1.0, 1.0])
    ours = replay(_Target(prompt + [END, 5, 6]), draft, prompt, max_new_tokens=16, eos={END}, p_min=0.5)
    assert ours.round_log == [(0, 2, END)]
    stderr = ("0.00.849.128 D accepted 0/3 draft tokens, the last target token is: (0)\n"
              "0.08.269.938 I encoded    3 tokens in    0.179 seconds, speed:  229.330 t/s\n"
              "0.08.269.940 I n_predict = 1\n0.08.269.940 I n_drafted = 3\n0.08.269.940 I n_accept  = 0\n")  # fmt: skip
    theirs = llamacpp.parse_run("\n\nP\n\n\n\n", stderr, "P")
    assert classify(theirs, ours, tie_tolerance=0.01, same_text=True) == (
        "near-tie", "round 1 of 1: the draft's top two logits are 0.004 apart"
    )


@pytest.mark.integration
@pytest.mark.skipif(_built_tools() is None, reason="llama.cpp's tools not built (draftforge eval llamacpp builds them)")
def test_llamacpp_itself_ends_a_round_at_an_end_of_turn_draft_as_the_replay_does(tmp_path):
    """Against llama.cpp's own decoding: a draft memorising "2 + 2 = 4<|im_end|>\\n..." drafts
    <|im_end|> in its block's third slot; llama.cpp logs that round as (2, 4, <|im_end|>). The
    replay before the fix logged (4, 4, <|im_end|>), a false 'differ' (seen with these settings)."""
    from draftforge.eval.speculative import DraftProposer, TargetSession
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.smollm2 import ensure_smollm2
    from draftforge.splitserve.target import build_target
    from draftforge.train.hf_load import load_exported_draft

    layer_ids = [1, 14, 27]
    target = build_target(TargetConfig(model="smollm2-135m-instruct", dtype="float32"), layer_ids)
    eos = set(target.eos_token_ids())
    text = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Reply with the number only."}], tokenize=False,
        add_generation_prompt=True)  # fmt: skip
    prompt = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    reference = _greedy_reference(target, prompt, 24)  # runs on past the end of the turn
    export = memorised_export(target, layer_ids, reference, len(prompt), steps=400, out=tmp_path / "export")
    source = llamacpp.source_dir()
    target_gguf = llamacpp.convert(source, ensure_smollm2(), tmp_path / "target.gguf")
    draft_gguf = llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())
    theirs = llamacpp.run_speculative(_built_tools(), target_gguf, draft_gguf, text, max_new_tokens=32, block_size=4)
    proposer = DraftProposer(load_exported_draft(export, target=target, dtype=torch.float32), temperature=0.0,
                             generator=torch.Generator().manual_seed(0), record_margins=True)
    stop = eos | theirs.end_tokens
    ours = replay(TargetSession(target.model, layer_ids), proposer, prompt, max_new_tokens=32, eos=stop)
    # the case this checks happened: a round whose drafts llama.cpp accepted up to an end-of-turn
    assert any(last in stop and accepted < drafted for accepted, drafted, last in theirs.round_log)
    assert theirs.round_log == ours.round_log
    shown = ours.tokens[:-1] if ours.tokens and ours.tokens[-1] in stop else ours.tokens
    assert classify(theirs, ours, tie_tolerance=0.01, same_text=theirs.text == target.tokenizer.decode(shown)) == (
        "agree", "")
