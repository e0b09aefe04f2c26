"""Session 56: the no-draft baseline's wall time counts its decoding alone.

Plain greedy decoding also records the lossless check's reference (each position's top-2
margin and near-tie gaps: a top-k over the vocabulary, a host copy). That work was inside the
timed span, so the baseline's tokens/s was understated and every speed-up over it overstated.
Here the recording is made to take a known, long time, and the decode's wall time must not
include it; the records themselves must still be there, one a token."""

from __future__ import annotations

import time

from test_speculative_r23 import PrefixTarget

import draftforge.eval.speculative as spec
from draftforge.eval.baselines import NoDraft

PAUSE_S = 0.05


def test_the_plain_decodes_reference_recording_is_left_out_of_its_wall_time(monkeypatch):
    real = spec._gaps
    calls = []

    def slow_gaps(logits):
        calls.append(1)
        time.sleep(PAUSE_S)
        return real(logits)

    monkeypatch.setattr(spec, "_gaps", slow_gaps)
    result = spec.speculative_decode(PrefixTarget(), [1, 2, 3], NoDraft(),
                                     spec.DecodeSettings(max_new_tokens=8, eos_token_ids=()))
    assert len(result.tokens) == 8 and len(calls) == 8
    assert len(result.top2_margins) == len(result.top_gaps) == 8
    assert result.wall_s < 0.5 * PAUSE_S * len(calls), result.wall_s  # 0.4 s of pauses left out


def test_a_sampled_plain_decode_records_no_reference():
    """The reference serves the greedy lossless check only."""
    result = spec.speculative_decode(PrefixTarget(), [1, 2, 3], NoDraft(),
                                     spec.DecodeSettings(max_new_tokens=8, eos_token_ids=(), temperature=1.0))
    assert len(result.tokens) == 8
    assert result.top2_margins is None and result.top_gaps is None
