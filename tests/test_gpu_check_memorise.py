"""Check 4's memorised draft on the CPU: fitted to a tiny random target's greedy answers, exported,
loaded back with draftforge's loader and decoded speculatively the way check 4 counts
(greedy, fixed length, EOS ignored), it accepts most of each block; a draft not fitted does not.
"""

from __future__ import annotations

import pytest
import torch
from eval_helpers import SHAPE, random_prompts, tiny_target

from draftforge.eval.speculative import (
    DecodeSettings,
    DraftProposer,
    TargetSession,
    speculative_decode,
)
from draftforge.splitserve import gpu_check_memorise as M
from draftforge.train.hf_load import load_exported_draft

# eval_helpers.draft_config as a recipe's draft section (block 4: at most 5 tokens a step)
DRAFT = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "target_layer_ids": [0, 1, 2], "block_size": 4, "mask_token_id": 3,
         "markov_rank": 16}
NEW_TOKENS = 24


def _tokens_per_step(folder, target, prompts):
    """Check 4's draftforge side: (tokens, verification rounds) pooled over the prompts, and the outputs."""
    draft = load_exported_draft(folder, target=target, dtype=torch.float32)
    session = TargetSession(target.model, DRAFT["target_layer_ids"])
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_ids=())
    results = [speculative_decode(session, p, DraftProposer(draft, temperature=0.0,
                                                            generator=torch.Generator()), settings)
               for p in prompts]
    return sum(len(r.tokens) for r in results) / sum(len(r.rounds) for r in results), [r.tokens for r in results]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_greedy_answers_have_the_fixed_length_of_plain_greedy_decoding(target):
    prompt = random_prompts(1, seed=5)[0]
    (answer,) = M.greedy_answers(target, [prompt], NEW_TOKENS)
    ids = list(prompt)
    with torch.no_grad():  # by hand: argmax of the full-sequence logits, one token at a time
        for _ in range(NEW_TOKENS):
            ids.append(int(target.logits(torch.tensor([ids]))[0, -1].argmax()))
    assert answer == ids[len(prompt):]


def test_the_memorised_draft_loads_back_and_accepts_most_of_each_block(target, tmp_path):
    prompts = [random_prompts(1, seed=5)[0], random_prompts(1, length=14, seed=8)[0]]
    lines = []
    memorised = M.memorise_draft(target, DRAFT, SHAPE, prompts, max_new_tokens=NEW_TOKENS,
                                 out_dir=tmp_path / "memorised-export", steps=60, progress=lines.append)
    assert memorised.folder == (tmp_path / "memorised-export").resolve()
    assert (memorised.folder / "config.json").is_file() and memorised.steps == 60
    assert any("step 60/60" in line for line in lines)
    tok_per_step, outputs = _tokens_per_step(memorised.folder, target, prompts)
    assert outputs == M.greedy_answers(target, prompts, NEW_TOKENS)  # lossless, fixed length
    assert tok_per_step > 3.0  # of at most 5 (block 4 + the bonus token); measured 4.36

    # the same draft, not fitted: about one token per step, what check 4 refuses
    fresh = M.memorise_draft(target, DRAFT, SHAPE, prompts, max_new_tokens=NEW_TOKENS,
                             out_dir=tmp_path / "fresh", steps=0, progress=lambda _: None)
    assert _tokens_per_step(fresh.folder, target, prompts)[0] < 1.3


def test_memorise_refuses_a_draft_reading_other_layers(target, tmp_path):
    with pytest.raises(ValueError, match=r"reads target layers \[0, 1\] but the target captures \[0, 1, 2\]"):
        M.memorise_draft(target, {**DRAFT, "target_layer_ids": [0, 1]}, SHAPE, [[5, 6, 7]],
                         max_new_tokens=4, out_dir=tmp_path / "x", steps=1, progress=lambda _: None)


# --------------------------------------------------------------------------- check 4's wiring


def test_check_four_serves_and_counts_the_memorised_draft(tmp_path, monkeypatch):
    """SGLang and draftforge's evaluator both get the memorised folder, never check 3's export."""
    import time

    from draftforge.splitserve import gpu_check as G
    from draftforge.splitserve import gpu_check_serving as S
    from draftforge.splitserve import smollm2
    from draftforge.splitserve import target as T

    setup = G.gpu_setup(tmp_path, 1)
    calls = {}
    ids, mask = torch.tensor([[7, 8, 9], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    monkeypatch.setattr(S, "sglang_has_dspark", lambda: (True, "0.0-test"))
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda *a: "/models/smol")
    monkeypatch.setattr(T, "load_tokenizer", lambda cfg: None)
    monkeypatch.setattr(S, "prompt_batch", lambda tokenizer, prompts: (ids, mask))

    def memorise(setup_, model, prompts):
        calls["memorise"] = (model, prompts)
        return M.Memorised(setup_.memorised_dir, 300, 0.25, 12.0)

    def serve(setup_, model, prompts, deadline, *, draft_dir):
        calls["serve"] = (model, prompts, draft_dir)
        return [S.SpecCounts(4, 1, 4.0, (1, 2, 3, 4)), S.SpecCounts(4, 2, 2.0, (5, 6, 7, 8))]

    def count(setup_, model, prompts, *, draft_dir):
        calls["count"] = (model, prompts, draft_dir)
        return [(4, 1), (4, 2)], [[1, 2, 3, 4], [5, 6, 7, 8]], {"acceptance_length": 8 / 3}

    monkeypatch.setattr(S, "memorise_for_check", memorise)
    monkeypatch.setattr(S, "serve_and_count", serve)
    monkeypatch.setattr(S, "draftforge_counts", count)
    result = S.check_sglang_dspark(setup, time.monotonic() + 60)
    assert result.status == G.PASS, result.line()
    prompts = [[7, 8, 9], [4, 5]]
    assert calls["memorise"] == ("/models/smol", prompts)
    assert calls["serve"] == ("/models/smol", prompts, tmp_path / "memorised-export")
    assert calls["count"] == ("/models/smol", prompts, tmp_path / "memorised-export")
    assert result.figures["memorise_loss"] == 0.25 and result.figures["memorise_s"] == 12.0


def test_memorise_for_check_fits_on_check_fours_float32_target(tmp_path, monkeypatch):
    from draftforge.splitserve import gpu_check as G
    from draftforge.splitserve import gpu_check_serving as S
    from draftforge.splitserve import target as T

    setup = G.gpu_setup(tmp_path, 1)
    seen = {}
    fake_target = object()

    def build(cfg, layers, *, device):
        seen["build"] = (cfg.model, cfg.dtype, layers, str(device))
        return fake_target

    def memorise(target, section, shape, prompts, *, max_new_tokens, out_dir, progress):
        seen["memorise"] = (target, section, prompts, max_new_tokens, out_dir)
        return M.Memorised(out_dir, 1, 0.5, 1.0)

    monkeypatch.setattr(T, "build_target", build)
    monkeypatch.setattr(S, "memorise_draft", memorise)
    memorised = S.memorise_for_check(setup, "/models/smol", [[1, 2]])
    assert memorised.folder == setup.memorised_dir == tmp_path / "memorised-export"
    # draftforge_counts' target: float32 on cuda:0, reading the draft's layers
    assert seen["build"] == ("/models/smol", "float32", list(G.LAYER_IDS), "cuda:0")
    assert seen["memorise"] == (fake_target, setup.draft, [[1, 2]], setup.max_new_tokens,
                                setup.memorised_dir)
