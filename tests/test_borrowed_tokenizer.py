"""SmolLM2's tokenizer cut to a random target's vocabulary (splitserve/borrowed_tokenizer.py).

Checked against SmolLM2's whole tokenizer, loaded by transformers from the converted folder:
the cut one must give the very ids the whole one gives wherever those are all below the cut,
never an id at or above it, and decode back to the text.
"""

from __future__ import annotations

import json

import pytest

from draftforge.errors import InputError
from draftforge.splitserve import borrowed_tokenizer as bt
from draftforge.splitserve import smollm2
from draftforge.splitserve.config import GenerationConfig, TargetConfig, TargetShape
from draftforge.splitserve.target import build_target, load_tokenizer

pytestmark = pytest.mark.integration  # reads the converted SmolLM2 folder

TEXTS = [
    "alpha beta gamma delta river stone cloud paper",
    "def square(x):\n    return x ** 2  # the square of x\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "Ünïcödé, emoji \U0001f600 and tabs\tand  double  spaces",
    "<|im_start|>user\nHello<|im_end|>\n",
]


@pytest.fixture(scope="module")
def whole():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2.ensure_smollm2()))


def _cut(vocab_size: int):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bt.tokenizer_dir(vocab_size)))


@pytest.mark.parametrize("vocab_size", [bt.MIN_VOCAB, 300, 2048])
def test_the_cut_tokenizer_stays_below_its_size_and_decodes_back(whole, vocab_size):
    cut = _cut(vocab_size)
    assert len(cut) == vocab_size
    for text in TEXTS:
        ids = cut.encode(text)
        assert max(ids) < vocab_size, text
        assert cut.decode(ids) == whole.decode(whole.encode(text)), text
    assert (cut.eos_token_id, cut.bos_token_id, cut.pad_token_id) == (
        whole.eos_token_id, whole.bos_token_id, whole.pad_token_id)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert (cut.apply_chat_template(conversation, tokenize=False)
            == whole.apply_chat_template(conversation, tokenize=False))


def test_where_the_whole_tokenizer_stays_below_the_cut_the_ids_are_the_same(whole):
    """Words the whole tokenizer makes of low ids only; 2048 keeps many whole words."""
    vocab_size = 2048
    cut = _cut(vocab_size)
    words = [w for w in (whole.convert_ids_to_tokens(i) for i in range(bt.MIN_VOCAB, vocab_size))
             if w.startswith("Ġ") and w[1:].isascii() and w[1:].isalpha()][:200]
    text = "".join(w.replace("Ġ", " ") for w in words) + " 3.14 == x;\n"
    ids = whole.encode(text)
    assert max(ids) < vocab_size and len(ids) >= 150  # the premise: low ids only, many of them
    assert cut.encode(text) == ids
    # and where the whole one uses a higher id, the cut one splits that word into smaller pieces
    high = next(i for i in range(vocab_size, 49152) if whole.convert_ids_to_tokens(i).startswith("Ġ"))
    word = whole.decode([high])
    assert whole.encode(word) == [high]
    assert len(cut.encode(word)) > 1 and cut.decode(cut.encode(word)) == word


def test_the_whole_vocabulary_borrows_smollm2s_own_folder():
    assert bt.tokenizer_dir(bt.FULL_VOCAB) == smollm2.ensure_smollm2()


@pytest.mark.parametrize("vocab_size", [bt.MIN_VOCAB - 1, bt.FULL_VOCAB + 1])
def test_sizes_without_a_tokenizer_are_refused_with_the_range(vocab_size):
    expected = f"vocab_size {vocab_size} has no tokenizer"
    with pytest.raises(InputError, match=expected):
        bt.tokenizer_dir(vocab_size)
    shape = TargetShape(num_hidden_layers=2, hidden_size=32, vocab_size=vocab_size)
    with pytest.raises(InputError, match=rf"{bt.MIN_VOCAB} <= target.shape.vocab_size <= {bt.FULL_VOCAB}"):
        load_tokenizer(TargetConfig(model="random", shape=shape))


def test_a_random_target_of_a_cut_vocabulary_generates_and_tokenises_with_it(whole):
    import torch

    shape = TargetShape(num_hidden_layers=2, hidden_size=32, vocab_size=1024)
    cfg = TargetConfig(model="random", shape=shape, dtype="float32")
    target = build_target(cfg, [0])
    assert len(target.tokenizer) == 1024 and len(load_tokenizer(cfg)) == 1024
    conversation = [{"role": "user", "content": "Hello"}]
    reply = target.generate([conversation], GenerationConfig(temperature=0.0, max_new_tokens=8))[0]
    assert isinstance(reply, str)
    # the reference: transformers' own greedy generate on the prompt the cut tokenizer renders,
    # cut at the first end-of-turn token and decoded by SmolLM2's whole tokenizer
    cut = _cut(1024)
    text = cut.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    prompt = cut(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert int(prompt.max()) < 1024
    eos = set(target.eos_token_ids())
    with torch.no_grad():
        out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=8, eos_token_id=sorted(eos), pad_token_id=cut.pad_token_id)
    new = out[0, prompt.shape[1]:].tolist()
    new = new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]
    assert new and max(new) < 1024
    expected = whole.decode(new, skip_special_tokens=True)
    if new[-1] not in eos:  # cut at max_new_tokens: it ends at its last whole character
        expected = expected.rstrip("\ufffd")
    assert str(reply) == expected != ""
    assert reply.finished == (new[-1] in eos)


def test_a_layout_other_than_smollm2s_is_not_cut():
    """Cutting relies on merge i making token 252 + i from earlier tokens; a tokenizer.json
    whose merges are in another order would lose tokens its kept merges need."""
    spec = json.loads((smollm2.ensure_smollm2() / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    with pytest.raises(ValueError, match=r"merge 0 .* makes token 253, not 252"):
        bt.cut_tokenizer_json(spec, 1000)


def test_a_half_written_folder_in_the_way_is_named(tmp_path):
    cache = tmp_path / "cache"
    source = smollm2.ensure_smollm2()
    (cache / smollm2.NAME).parent.mkdir(parents=True)
    (cache / smollm2.NAME).symlink_to(source)  # the converted model, without converting again
    blocking = cache / f"{smollm2.NAME}-tokenizer-600"
    blocking.mkdir()
    (blocking / "tokenizer.json").write_text("{}")
    with pytest.raises(InputError, match=f"{blocking} exists but is not a cut tokenizer folder"):
        bt.tokenizer_dir(600, cache)
    assert not list(cache.glob(".*tmp-*"))  # its own temporary folder is gone
