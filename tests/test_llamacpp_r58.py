"""Session 58: llama.cpp's printed text against draftforge's tokens, as llama.cpp prints them.

``eval llamacpp`` compared llama.cpp's text with ``tokenizer.decode(tokens)``, which for a
tokenizer that cleans up spaces (``clean_up_tokenization_spaces``, which some tokenizer configs
set) drops the space before punctuation: the same tokens read as "a different text".
"""

from __future__ import annotations

import pytest

from draftforge.eval.llamacpp_check import same_text


@pytest.mark.integration
def test_the_text_is_compared_without_clean_up():
    from transformers import AutoTokenizer

    from draftforge.splitserve import smollm2

    # transformers 5 ignores the clean-up for a BPE tokenizer unless forced; a WordPiece or
    # SentencePiece tokenizer whose config sets it cleans up by default
    tokenizer = AutoTokenizer.from_pretrained(
        smollm2.ensure_smollm2(), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    printed = "Hello , world . It isn ' t"  # llama.cpp prints each token's piece as it is
    tokens = tokenizer(printed, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokens) == "Hello, world. It isn't"  # what the check compared before
    assert same_text(printed, tokenizer, tokens)
    assert not same_text("Hello, world. It isn't", tokenizer, tokens)
