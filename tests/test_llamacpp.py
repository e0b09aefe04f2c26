"""llama.cpp reads draftforge's exports as draftforge means them.

- The converter test runs llama.cpp's own ``convert_hf_to_gguf.py`` (from the
  llama-cpp-python 0.3.36 source archive that ``make install`` fetches) on an
  export and reads the GGUF back: every exported tensor must arrive, unchanged,
  under the name llama.cpp's DSpark runtime loads, with the DSpark metadata.
- The schedule tests check :func:`replay`, draftforge's side of
  ``draftforge eval llamacpp``, against counts derived by hand from
  llama-speculative-simple's loop.
- The decoding test runs llama.cpp's ``draft-dspark`` decoding itself on a draft
  fitted to one SmolLM2 answer; it needs the built binary (``draftforge eval
  llamacpp`` builds it once, about 5 minutes) and is skipped without it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from eval_helpers import random_prompts, tiny_eval_draft, tiny_target

from draftforge.errors import InputError
from draftforge.eval import llamacpp, llamacpp_check
from draftforge.eval.llamacpp_check import Replay, classify, replay
from draftforge.eval.speculative import (
    DecodeSettings,
    DraftProposer,
    Proposal,
    Proposer,
    TargetSession,
    speculative_decode,
)
from draftforge.train.export import export_draft
from draftforge.train.model import DSparkConfig, DSparkDraft

# ----------------------------------------------------------------------------- parsing the tool's output

STDERR = """0.00.100.000 I main: loading
0.00.849.128 D accepted 0/8 draft tokens, the last target token is: (3725)
0.00.917.421 D accepted 2/8 draft tokens, the last target token is: (5367)
0.00.985.614 D accepted 1/8 draft tokens, the last target token is: (2)
0.08.269.938 I encoded   41 tokens in    0.179 seconds, speed:  229.330 t/s
0.08.269.940 I n_draft   = 8
0.08.269.940 I n_predict = 6
0.08.269.940 I n_drafted = 24
0.08.269.940 I n_accept  = 3
"""


def test_parse_run_reads_the_counts_rounds_and_generated_text():
    run = llamacpp.parse_run("\n\nPROMPT\nanswer\n\n\n\n\n", STDERR, "PROMPT\n")
    assert (run.prompt_tokens, run.predicted, run.drafted, run.accepted) == (41, 6, 24, 3)
    assert run.round_log == [(0, 8, 3725), (2, 8, 5367), (1, 8, 2)]
    assert run.text == "answer\n"  # the answer's own trailing newline is kept
    assert run.rounds == 3 and run.acceptance_length == pytest.approx(2.0)


def test_parse_run_refuses_output_it_does_not_recognise():
    with pytest.raises(InputError, match="n_accept"):
        llamacpp.parse_run("\n\nP\n\n\n\n", STDERR.replace("n_accept", "n_acc"), "P")
    with pytest.raises(InputError, match="did not echo the prompt"):
        llamacpp.parse_run("\n\nOTHER\n\n\n\n", STDERR, "PROMPT")
    with pytest.raises(InputError, match="logged 2 rounds but its totals imply 3"):
        llamacpp.parse_run("\n\nP\n\n\n\n", STDERR.replace("accepted 0/8", "skipped 0/8"), "P")
    without_rounds = "\n".join(line for line in STDERR.splitlines() if " D accepted " not in line)
    with pytest.raises(InputError, match="logged 0 rounds but its totals imply 3"):  # run without -v
        llamacpp.parse_run("\n\nP\n\n\n\n", without_rounds, "P")


def test_parse_run_names_a_bos_token_echoed_before_the_prompt():
    # a vocabulary with add_bos_token: llama.cpp prints the BOS piece, then the prompt
    out = "\n\n<s>PROMPT\nanswer\n\n\n\n\n"
    with pytest.raises(InputError, match="echoed the BOS token '<s>' before the prompt.*add_bos_token"):
        llamacpp.parse_run(out, STDERR, "PROMPT\n", bos="<s>")
    with pytest.raises(InputError, match="did not echo the prompt as expected"):  # another BOS: not named
        llamacpp.parse_run(out, STDERR, "PROMPT\n", bos="<|begin_of_text|>")
    # a prompt that itself starts with the BOS text, echoed as it is, is read as before
    assert llamacpp.parse_run("\n\n<s>PROMPT\nanswer\n\n\n\n\n", STDERR, "<s>PROMPT\n", bos="<s>").text == "answer\n"


def _replay(log, target_margins, draft_margins, prompt_tokens=41):
    return Replay(prompt_tokens=prompt_tokens, predicted=0, drafted=0, accepted=0, tokens=[], round_log=log,
                  target_margins=target_margins, draft_margins=draft_margins)  # fmt: skip


def test_classify_reports_prompts_of_different_lengths_as_a_tokenization_difference():
    theirs = llamacpp.parse_run("\n\nP\n\n\n\n", STDERR, "P")  # encoded 41 tokens
    # every round the same, yet llama.cpp decoded one token more (an end token its vocabulary adds)
    ours = _replay(list(theirs.round_log), [1.0] * 3, [1.0] * 3, prompt_tokens=40)
    assert classify(theirs, ours, tie_tolerance=0.01, same_text=True) == (
        "differ",
        "llama.cpp decoded a prompt of 41 tokens, draftforge one of 40 "
        "(tokenization: llama-tokenize and llama-speculative-simple disagree)",
    )
    # ... found before the rounds, which would otherwise blame a near-tie or round 1
    other = _replay([(0, 8, 1), (0, 8, 2), (0, 8, 3)], [0.001] * 3, [1.0] * 3, prompt_tokens=42)
    assert classify(theirs, other, tie_tolerance=0.01, same_text=False)[1].startswith("llama.cpp decoded a prompt of 41")


def test_classify_agree_near_tie_and_differ():
    theirs = llamacpp.parse_run("\n\nP\n\n\n\n", STDERR, "P")
    same = _replay(list(theirs.round_log), [1.0] * 3, [1.0] * 3)
    assert classify(theirs, same, tie_tolerance=0.01, same_text=True) == ("agree", "")
    # round 2 differs where draftforge's target had two logits 0.004 apart: either may win
    other = [(0, 8, 3725), (3, 8, 77), (0, 8, 2)]
    status, detail = classify(theirs, _replay(other, [1.0, 0.004, 1.0], [1.0] * 3), tie_tolerance=0.01, same_text=False)
    assert status == "near-tie" and "round 2 of 3: the target's top two logits are 0.004 apart" in detail
    # the same difference with clear margins on both sides is a failure
    status, detail = classify(theirs, _replay(other, [1.0, 0.5, 1.0], [1.0, 0.2, 1.0]), tie_tolerance=0.01, same_text=False)
    assert status == "differ" and "llama.cpp (2, 8, 5367) against draftforge (3, 8, 77)" in detail
    # identical rounds but different text (a decoding difference) is not an agreement either
    assert classify(theirs, same, tie_tolerance=0.01, same_text=False)[0] == "differ"


def test_classify_goes_on_past_a_confidence_cut_that_emits_the_same_tokens():
    theirs = llamacpp.parse_run("\n\nP\n\n\n\n", STDERR, "P")
    fewer = [(0, 8, 3725), (2, 5, 5367), (1, 8, 2)]  # round 2 cut after 5 drafts, same tokens out
    close = _replay(fewer, [1.0] * 3, [1.0] * 3)
    close.confidence_margins = [1.0, 2e-5, 1.0]
    status, detail = classify(theirs, close, tie_tolerance=0.01, same_text=True)
    assert status == "near-tie" and detail == "round 2 of 3: a confidence logit lies 2e-05 from the --p-min cut"
    # ... and a real difference after it is still found
    later = _replay([(0, 8, 3725), (2, 5, 5367), (0, 8, 9)], [1.0] * 3, [1.0] * 3)
    later.confidence_margins = [1.0, 2e-5, 1.0]
    assert classify(theirs, later, tie_tolerance=0.01, same_text=False)[0] == "differ"


# ----------------------------------------------------------------------------- fetching the source


def test_fetch_reuses_a_complete_copy_without_the_network(tmp_path, monkeypatch):
    dest = llamacpp.source_dir(tmp_path)
    dest.mkdir(parents=True)
    (dest / llamacpp.CONVERTER).write_text("# converter\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert llamacpp.fetch_source(tmp_path, progress=lambda _: None) == dest


def test_fetch_failure_is_clear_and_leaves_nothing(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(InputError, match="could not download llama-cpp-python==0.3.36.*No matching distribution"):
        llamacpp.fetch_source(tmp_path, progress=lambda _: None)
    assert list(tmp_path.iterdir()) == []  # no half-unpacked tree a later run would trust


def test_build_without_a_compiler_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    with pytest.raises(InputError, match="needs cmake .*--llama-cpp DIR"):
        llamacpp.build_tools(tmp_path, progress=lambda _: None)


# ----------------------------------------------------------------------------- the schedule


class Oracle(Proposer):
    """Proposes the reference continuation itself, with fixed confidence logits."""

    name = "oracle"
    needs_features = True

    def __init__(self, reference: list[int], block: int, confidence: list[float]):
        self.reference, self.block, self.confidence = reference, block, confidence

    def propose(self, sequence, features):
        start = len(sequence)
        return Proposal(tokens=self.reference[start : start + self.block], confidence_logits=self.confidence)


def _greedy_reference(target, prompt, length):
    out = speculative_decode(TargetSession(target.model, None), prompt, Proposer(), DecodeSettings(max_new_tokens=length))
    return list(prompt) + out.tokens


@pytest.mark.parametrize(
    "confidence, p_min, expected",
    [
        # block 4, 10 new tokens. Rounds draft min(4, 10 - emitted - 1) tokens, or a whole block once
        # that limit is 0 or less: 4 -> 5 out, 4 -> 10 out, limit -1 so 4 -> 15 out > 10: stop.
        ([3.0, 3.0, 3.0, 3.0], 0.0, dict(predicted=15, drafted=12, accepted=12)),
        # The same, cut before the first slot below p_min (sigmoid(-3) = 0.05): 2 -> 3, 2 -> 6,
        # limit 3 so 3 then 2 -> 9, limit 0 so 4 then 2 -> 12 > 10: stop.
        ([3.0, 3.0, -3.0, 3.0], 0.5, dict(predicted=12, drafted=8, accepted=8)),
    ],
)
def test_replay_follows_llama_speculative_simple(confidence, p_min, expected):
    target = tiny_target(sharpness=4.0)
    prompt = random_prompts(1, seed=5)[0]
    reference = _greedy_reference(target, prompt, 40)
    session = TargetSession(target.model, [0, 1, 2])
    run = replay(session, Oracle(reference, 4, confidence), prompt, max_new_tokens=10, eos=set(), p_min=p_min)
    assert dict(predicted=run.predicted, drafted=run.drafted, accepted=run.accepted) == expected
    assert len(run.round_log) == run.rounds and sum(r[0] for r in run.round_log) == run.accepted
    # the first round drafts from the prompt's last token: what comes out is the greedy answer
    assert run.tokens == reference[len(prompt) : len(prompt) + run.predicted]


def test_replay_with_a_real_draft_is_lossless_and_stops_at_the_end_token():
    target = tiny_target(sharpness=4.0)
    draft = tiny_eval_draft(target)
    prompt = random_prompts(1, seed=7)[0]
    reference = _greedy_reference(target, prompt, 30)
    end = reference[len(prompt) + 11]  # make the 12th answer token the end of turn
    first = reference.index(end, len(prompt))
    proposer = DraftProposer(draft, temperature=0.0, generator=torch.Generator().manual_seed(0))
    run = replay(TargetSession(target.model, [0, 1, 2]), proposer, prompt, max_new_tokens=30, eos={end})
    assert run.tokens == reference[len(prompt) : first + 1]
    assert run.predicted >= len(run.tokens)  # a round's tokens after the end are counted, not kept
    assert run.rounds >= 1 and run.accepted <= run.drafted


# ----------------------------------------------------------------------------- llama.cpp's converter

# draftforge's tensor names and the names llama.cpp's DSpark runtime loads them by
# (gguf-py's tensor map for MODEL_ARCH.DFLASH, read off the converted files).
GGUF_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(name: str) -> str:
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"blk.{index}.{LAYER_NAMES[rest]}"
    return GGUF_NAMES[name]


def _smollm2_shaped_draft(**overrides) -> DSparkDraft:
    torch.manual_seed(0)
    fields = dict(
        vocab_size=49152, hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=96, target_hidden_size=576, num_target_layers=30, target_layer_ids=[1, 14, 27],
        block_size=4, mask_token_id=16, markov_rank=8, enable_confidence_head=True,
        confidence_head_with_markov=True, max_position_embeddings=2048,
    )  # fmt: skip
    draft = DSparkDraft(DSparkConfig(**{**fields, **overrides}))
    with torch.no_grad():
        for param in draft.parameters():
            param.normal_(0, 0.5)  # every tensor distinct from its initial value
    return draft


@pytest.mark.integration
def test_llamacpp_converter_takes_the_export_as_it_is(tmp_path):
    import gguf
    from safetensors.torch import load_file

    from draftforge.splitserve.smollm2 import ensure_smollm2

    source = llamacpp.fetch_source()
    draft = _smollm2_shaped_draft()
    export = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    out = llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())

    reader = gguf.GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")
              or name == "tokenizer.ggml.mask_token_id"}  # fmt: skip
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_count"] == 2
    assert fields["dflash.block_size"] == 4
    assert fields["dflash.target_layers"] == [2, 15, 28]  # llama.cpp counts layer outputs from 1
    assert fields["tokenizer.ggml.mask_token_id"] == 16
    assert fields["dflash.sample_from_anchor"] is True  # the anchor slot predicts, as in draftforge
    assert fields["dflash.has_confidence_head"] is True

    exported = load_file(export / "model.safetensors")
    converted = {t.name: t for t in reader.tensors}
    assert sorted(converted) == sorted(_gguf_name(name) for name in exported)
    for name, tensor in exported.items():
        got = converted[_gguf_name(name)]
        assert tuple(int(d) for d in reversed(got.shape)) == tuple(tensor.shape), name  # GGUF lists dims inner first
        np.testing.assert_array_equal(np.asarray(got.data).reshape(-1), tensor.float().numpy().reshape(-1), err_msg=name)


@pytest.mark.integration
@pytest.mark.parametrize("tied", [False, True])
def test_llamacpp_converter_never_keeps_an_exports_embedding_copy(tmp_path, tied):
    """--with-embeddings: the converter drops a full-vocabulary lm_head, and llama.cpp's runtime uses
    a kept token_embd as the draft's embedding and output head. The GGUF holds neither copy, tied or
    not, so llama.cpp uses the target's own, as SGLang does (a tied copy was kept until session 50,
    though a bf16 export rounds an fp32 target's)."""
    import gguf
    from safetensors.torch import load_file

    from draftforge.splitserve.smollm2 import ensure_smollm2

    source = llamacpp.fetch_source()
    draft = _smollm2_shaped_draft(num_hidden_layers=1)
    if tied:
        with torch.no_grad():
            draft.lm_head.weight.copy_(draft.embed_tokens.weight)
    assert torch.equal(draft.embed_tokens.weight, draft.lm_head.weight) == tied
    export = export_draft(draft, tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    out = llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())

    converted = {t.name: t for t in gguf.GGUFReader(out).tensors}
    exported = load_file(export / "model.safetensors")
    own = sorted(_gguf_name(name) for name in exported if name not in ("embed_tokens.weight", "lm_head.weight"))
    assert sorted(converted) == own  # the GGUF of the export without embeddings


@pytest.mark.integration
@pytest.mark.parametrize("overrides", [dict(markov_head_type="gated"), dict(markov_head_type="rnn"),
                                       dict(confidence_head_with_markov=False)])  # fmt: skip
def test_drafts_llamacpp_cannot_run_are_carded_sglang_only(tmp_path, overrides):
    """What llama.cpp does with the drafts whose model card says SGLang only: its converter
    refuses other Markov heads; a confidence head without the Markov input converts, but as
    [1, H], where the runtime (src/models/dflash.cpp) loads conf_proj.weight as [H + rank, 1]."""
    import gguf

    from draftforge.splitserve.smollm2 import ensure_smollm2

    source = llamacpp.fetch_source()
    draft = _smollm2_shaped_draft(num_hidden_layers=1, **overrides)
    export = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    card = (export / "README.md").read_text()
    assert "SGLang only: llama.cpp cannot run this draft" in card and "llama-server" not in card
    if "markov_head_type" in overrides:
        with pytest.raises(InputError, match="only 'vanilla' is supported"):
            llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())
        return
    out = llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())
    conf = {t.name: t for t in gguf.GGUFReader(out).tensors}["conf_proj.weight"]
    hidden, rank = draft.config.hidden_size, draft.config.markov_rank
    assert [int(d) for d in conf.shape] == [hidden, 1] != [hidden + rank, 1]  # GGUF: inner dim first


def test_converter_refusal_is_reported_with_its_reason(tmp_path):
    source = tmp_path / "llama.cpp"
    source.mkdir()
    (source / llamacpp.CONVERTER).write_text("import sys\nsys.exit('unsupported markov_head_type gated')\n")
    with pytest.raises(InputError, match="refused .*unsupported markov_head_type gated"):
        llamacpp.convert(source, tmp_path, tmp_path / "out.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


# ----------------------------------------------------------------------------- llama.cpp's decoding


def _built_tools() -> Path | None:
    bin_dir = llamacpp.source_dir() / "build" / "bin"
    return bin_dir if all((bin_dir / t).is_file() for t in (llamacpp.TOOL, llamacpp.TOKENIZER)) else None


def memorised_export(target, layer_ids, reference, prompt_len, *, steps, out) -> Path:
    """Export a 1-layer draft of block 4 fitted for ``steps`` steps to ``reference`` (a prompt of
    ``prompt_len`` tokens and its answer), anchored from the prompt's last token on, as
    llama.cpp's first round drafts from it."""
    from draftforge.train.blocks import sample_anchors

    ids = torch.tensor([reference])
    feats = target.features(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, prompt_len - 1 :] = True
    torch.manual_seed(0)
    cfg = DSparkConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=768, target_hidden_size=576, num_target_layers=30, target_layer_ids=layer_ids,
        block_size=4, mask_token_id=16, markov_rank=16, enable_confidence_head=True,
        confidence_head_with_markov=True, max_position_embeddings=2048,
    )  # fmt: skip
    draft = DSparkDraft(cfg)
    draft.load_target_embeddings(target.embed_tokens_weight(), target.lm_head_weight())
    optimizer = torch.optim.AdamW(draft.trainable_parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors, valid = sample_anchors(mask, 48, generator=generator)
        loss = draft(ids, mask, feats.aux, feats.final, anchors, valid,
                     objective=dict(ce_weight=1.0, tv_weight=0.5)).loss  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return export_draft(draft.eval(), out, progress=lambda _: None)


@pytest.mark.integration
@pytest.mark.skipif(_built_tools() is None, reason="llama.cpp's tools not built (draftforge eval llamacpp builds them)")
def test_llamacpp_decodes_a_memorised_answer_as_draftforge_does(tmp_path):
    """A draft fitted to one SmolLM2 answer: llama.cpp's draft-dspark decoding must give the same
    output and accept exactly as many drafts as draftforge on the same schedule."""
    from draftforge.eval.cli import workload_texts
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.smollm2 import ensure_smollm2
    from draftforge.splitserve.target import build_target
    from draftforge.train.hf_load import load_exported_draft

    layer_ids = [1, 14, 27]
    target_cfg = TargetConfig(model="smollm2-135m-instruct", dtype="float32")
    target = build_target(target_cfg, layer_ids)
    eos = set(target.eos_token_ids())
    text = workload_texts("gsm8k", target.tokenizer, target_cfg.generation, 1)[0]
    prompt = target.tokenizer(text, add_special_tokens=False)["input_ids"]
    new_tokens = 48
    reference = _greedy_reference(target, prompt, new_tokens + 16)
    export = memorised_export(target, layer_ids, reference, len(prompt), steps=150, out=tmp_path / "export")
    source = llamacpp.source_dir()
    target_gguf = llamacpp.convert(source, ensure_smollm2(), tmp_path / "target.gguf")
    draft_gguf = llamacpp.convert(source, export, tmp_path / "draft.gguf", target_dir=ensure_smollm2())
    bin_dir = _built_tools()
    assert llamacpp.tokenize(bin_dir, target_gguf, text) == prompt
    theirs = llamacpp.run_speculative(bin_dir, target_gguf, draft_gguf, text, max_new_tokens=new_tokens, block_size=4)

    loaded = load_exported_draft(export, target=target, dtype=torch.float32)
    proposer = DraftProposer(loaded, temperature=0.0, generator=torch.Generator().manual_seed(0))
    ours = replay(TargetSession(target.model, layer_ids), proposer, prompt, max_new_tokens=new_tokens, eos=eos)
    assert theirs.text == target.tokenizer.decode([t for t in ours.tokens if t not in eos])
    assert theirs.round_log == ours.round_log  # round for round: accepted, drafted, last token
    # and the drafted tokens themselves, read off llama.cpp's -v candidate lines (session 50)
    assert len(theirs.round_drafts) == len(ours.round_drafts) > 0
    assert [log[: len(mine)] for log, mine in zip(theirs.round_drafts, ours.round_drafts, strict=True)] == ours.round_drafts
    assert classify(theirs, ours, tie_tolerance=0.01, same_text=True) == ("agree", "")
    assert (theirs.prompt_tokens, theirs.predicted, theirs.drafted, theirs.accepted) == (
        ours.prompt_tokens, ours.predicted, ours.drafted, ours.accepted,
    )  # fmt: skip
    # most drafts accepted (35 of 60 when this was written), so later slots take part too
    assert theirs.accepted >= theirs.drafted / 2


# ----------------------------------------------------------------------------- the command, llama.cpp failing


class _Tokenizer:
    bos_token = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1, 2, 3]}

    def decode(self, ids, clean_up_tokenization_spaces=None):
        return "".join(chr(ord("a") + i) for i in ids)


def _fake_check(tmp_path, monkeypatch, failure: Exception):
    """``draftforge eval llamacpp`` with llama.cpp and both models faked: two prompts, and
    llama.cpp raising ``failure`` on the second. Returns (arguments, the run_speculative calls)."""
    from draftforge.eval import cli as eval_cli
    from draftforge.eval import speculative
    from draftforge.splitserve import target as target_module
    from draftforge.train import hf_load

    export, source = tmp_path / "export", tmp_path / "llama.cpp"
    export.mkdir(exist_ok=True)
    (export / "config.json").write_text("{}")
    for need in (source / llamacpp.CONVERTER, source / "build/bin" / llamacpp.TOOL, source / "build/bin" / llamacpp.TOKENIZER):
        need.parent.mkdir(parents=True, exist_ok=True)
        need.write_text("")
    monkeypatch.setattr(llamacpp_check, "_target_folder", lambda cfg: tmp_path / "target")
    monkeypatch.setattr(llamacpp, "convert", lambda source, model, out, **kw: Path(out))
    monkeypatch.setattr(llamacpp, "tokenize", lambda bin_dir, gguf, text: [1, 2, 3])
    calls = []

    def run_speculative(bin_dir, target_gguf, draft_gguf, text, **kw):
        calls.append(dict(kw, text=text))
        if text == "second":
            raise failure
        return llamacpp.SpecRun(prompt_tokens=3, predicted=2, drafted=4, accepted=1, text="fh", round_log=[(1, 4, 7)])

    monkeypatch.setattr(llamacpp, "run_speculative", run_speculative)
    monkeypatch.setattr(llamacpp_check, "replay", lambda *a, **kw: Replay(
        3, 2, 4, 1, [5, 7], [(1, 4, 7)], target_margins=[1.0], draft_margins=[1.0]))  # fmt: skip
    monkeypatch.setattr(eval_cli, "workload_texts", lambda name, tok, gen, n: ["first", "second"])
    monkeypatch.setattr(hf_load, "read_serving_config", lambda folder: {})
    monkeypatch.setattr(hf_load, "config_from_serving", lambda cfg, where: SimpleNamespace(
        target_layer_ids=[0], block_size=4, enable_confidence_head=False, markov_head_type="vanilla",
        confidence_head_with_markov=True))
    monkeypatch.setattr(hf_load, "load_exported_draft", lambda *a, **kw: None)
    fake_target = SimpleNamespace(tokenizer=_Tokenizer(), eos_token_ids=lambda: [0], model=None)
    monkeypatch.setattr(target_module, "build_target", lambda cfg, ids: fake_target)
    monkeypatch.setattr(speculative, "TargetSession", lambda *a, **kw: None)
    monkeypatch.setattr(speculative, "DraftProposer", lambda *a, **kw: None)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-cpu.yaml"
    args = [str(export), "--recipe", str(recipe), "--llama-cpp", str(source), "--workloads", "gsm8k",
            "--num-prompts", "2", "--max-new-tokens", "16", "--json", str(tmp_path / "out.json")]  # fmt: skip
    return args, calls


def test_a_llamacpp_failure_on_one_prompt_is_an_error_that_fails_the_check(tmp_path, monkeypatch, capsys):
    abort = InputError("llama-speculative-simple failed (exit 134): GGML_ASSERT(ggml_nelements(a) == ne0) failed")
    args, calls = _fake_check(tmp_path, monkeypatch, abort)
    assert llamacpp_check.main(args) == 1  # a difference, not bad input (2)
    records = json.loads((tmp_path / "out.json").read_text())
    assert [(r["index"], r["status"]) for r in records] == [(0, "agree"), (1, "error")]
    assert records[0]["llamacpp"] == {"prompt_tokens": 3, "predicted": 2, "drafted": 4, "accepted": 1}
    assert "GGML_ASSERT" in records[1]["detail"] and records[1]["llamacpp"] == {}
    out = capsys.readouterr().out
    assert "| gsm8k | 2 | 1 | 0 | 0 | 1 | 2.000 | 2.000 |" in out  # the error left out of the AL
    assert "llamacpp_prompts=2 agree=1 near_tie=0 differ=0 error=1 " in out
    assert [c["timeout_s"] for c in calls] == [600 + 5 * 16] * 2  # the default, scaled with -n
    _, calls = _fake_check(tmp_path, monkeypatch, abort)
    llamacpp_check.main([*args, "--timeout-s", "30"])
    assert calls[0]["timeout_s"] == 30


def test_a_check_cut_short_keeps_the_prompts_it_did(tmp_path, monkeypatch):
    args, _ = _fake_check(tmp_path, monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llamacpp_check.main(args)
    assert [r["status"] for r in json.loads((tmp_path / "out.json").read_text())] == ["agree"]


def test_run_speculative_past_its_timeout_is_an_input_error(tmp_path, monkeypatch):
    def slow(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(subprocess, "run", slow)
    with pytest.raises(InputError, match="ran past 30 s on one prompt"):
        llamacpp.run_speculative(tmp_path, tmp_path / "t.gguf", tmp_path / "d.gguf", "P", max_new_tokens=4,
                                 block_size=4, timeout_s=30)  # fmt: skip
