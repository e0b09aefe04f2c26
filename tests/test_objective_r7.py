"""Review round 7 of the objective area: the bigram init's refusals are user errors."""

from __future__ import annotations

import pytest
from dspark_helpers import tiny_draft

from draftforge.errors import InputError
from draftforge.train.markov_init import init_markov_bigram


@pytest.mark.parametrize(
    ("sequences", "reason"),
    [([[1, 2, 3]], "too little data for a bigram table"), ([[7], []], "hold no token pair")],
)
def test_bigram_init_without_enough_samples_is_an_input_error(sequences, reason):
    """Too few training samples for a table is the user's data, not a bug: an InputError (the
    trainer rank prints its message and exits with status 2, no traceback) that says what to do."""
    with pytest.raises(InputError, match=rf"train\.markov_init: bigram: .*{reason}.*train\.markov_init=random"):
        init_markov_bigram(tiny_draft(markov_rank=8), sequences)
