"""The SGLang backend after a review (session 48): a target folder it cannot use is named in an
InputError as the transformers backend names it, not a library traceback. Runs without SGLang
(its presence is simulated: the constructor reads only the folder)."""

from __future__ import annotations

import json
import shutil

import pytest
from test_target_capture import save_tiny_target

from draftforge.errors import InputError
from draftforge.splitserve import sglang_backend
from draftforge.splitserve.config import TargetConfig
from draftforge.splitserve.sglang_backend import SGLANG_VERSION, SGLangTarget

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("sglang-r48-target"))


def _copy(saved, tmp_path, *, tokenizer: bool = True):
    folder = tmp_path / "target"
    shutil.copytree(saved, folder)
    if not tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"):
            (folder / name).unlink(missing_ok=True)
    return folder


def test_a_folder_without_a_tokenizer_is_named(monkeypatch, saved, tmp_path):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    folder = _copy(saved, tmp_path, tokenizer=False)
    with pytest.raises(InputError, match=f"target folder {folder} has no tokenizer"):
        SGLangTarget(folder, LAYERS, TargetConfig(model=str(folder), dtype="float32"))


def test_a_config_needing_remote_code_names_the_setting(monkeypatch, saved, tmp_path):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    folder = _copy(saved, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="made_up_r48", auto_map={"AutoConfig": "configuration_x.XConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="set target.trust_remote_code: true only if you trust"):
        SGLangTarget(folder, LAYERS, TargetConfig(model=str(folder), dtype="float32"))


def test_a_config_of_an_unknown_type_is_an_input_error(monkeypatch, saved, tmp_path):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    folder = _copy(saved, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "made_up_r48"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=f"target folder {folder}: transformers cannot read its config.json"):
        SGLangTarget(folder, LAYERS, TargetConfig(model=str(folder), dtype="float32"))


def _failing_rank(monkeypatch, closed, *, close_fails=False):
    """A target rank whose producer fails, its transport and target replaced by fakes."""
    import types

    from draftforge.splitserve import producer, roles

    class Engine:
        def close(self):
            closed.append("close")
            if close_fails:
                raise RuntimeError("runner already gone")

    class Quiet:
        def __init__(self, *args, **kwargs): ...
        def expect(self, *args): ...

    def fails(*args, **kwargs):
        raise RuntimeError("a chunk's features failed")

    monkeypatch.setattr(roles.T, "Pulse", Quiet)
    monkeypatch.setattr(roles.T, "AckListener", Quiet)
    monkeypatch.setattr(roles, "build_engine", lambda ctx: Engine())
    monkeypatch.setattr(producer, "embedding_dests", lambda topology, rank: [1])
    monkeypatch.setattr(producer, "send_embeddings", lambda *args, **kwargs: None)
    monkeypatch.setattr(producer, "run_producer", fails)
    logged = []
    ctx = types.SimpleNamespace(
        rank=0, topology=types.SimpleNamespace(producers=[0], dests=lambda rank: [1]),
        cfg=types.SimpleNamespace(split=types.SimpleNamespace(peer_timeout_s=60)),
        data_group=None, ack_group=None, device="cpu", log=logged.append, tp_group=None)
    return roles, ctx, logged


def test_a_failed_target_rank_closes_its_instances_before_the_error_propagates(monkeypatch):
    """Left to the exit, SGLang's Engine.shutdown (atexit) SIGKILLs the feature runner's
    processes, leaving their shared memory behind; close() stops the runner first."""
    closed = []
    roles, ctx, logged = _failing_rank(monkeypatch, closed)
    with pytest.raises(RuntimeError, match="a chunk's features failed"):
        roles._run_target(ctx, bench=None)
    assert closed == ["close"]
    closed.clear()
    roles, ctx, logged = _failing_rank(monkeypatch, closed, close_fails=True)
    with pytest.raises(RuntimeError, match="a chunk's features failed"):  # the first error, not close's
        roles._run_target(ctx, bench=None)
    assert closed == ["close"]
    assert any("closing the target after the failure failed too" in line for line in logged)


def _sglang_joint_rule(probs, top_k, top_p):
    """SGLang's torch sampler, restated: sort, cut past top_k, and cut where the mass of the
    whole distribution before a token exceeds top_p (no renormalisation in between)."""
    import torch

    probs_sort, order = probs.sort(descending=True)
    before = probs_sort.cumsum(0) - probs_sort
    keep = (torch.arange(len(probs)) < top_k) & ~(before > top_p)
    return sorted(order[keep].tolist())


def test_the_two_backends_nuclei_differ_as_the_note_says():
    """probabilities .4 .3 .2 .1, top_k 2, top_p 0.5: transformers' order (top-k, renormalise,
    then top-p) keeps token 0 alone (0.571 >= 0.5); SGLang's joint cut keeps 0 and 1 (the
    mass before token 1 is 0.4 <= 0.5). Greedy, or either filter off, is the same on both."""
    import torch

    from draftforge.splitserve.config import GenerationConfig
    from draftforge.splitserve.sampling import top_k_top_p
    from draftforge.splitserve.sglang_backend import joint_filter_note

    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    probs, ids = top_k_top_p(logits, 1.0, 2, 0.5)
    assert sorted(ids[probs > 0].tolist()) == [0]
    assert _sglang_joint_rule(logits.softmax(-1), 2, 0.5) == [0, 1]
    both = GenerationConfig(temperature=0.7, top_k=2, top_p=0.5)
    assert "SGLang cuts both on the whole distribution" in joint_filter_note(both)
    for same in (GenerationConfig(temperature=0, top_k=2, top_p=0.5), GenerationConfig(top_k=0, top_p=0.5),
                 GenerationConfig(top_k=20, top_p=1.0)):
        assert joint_filter_note(same) is None


def test_the_sglang_target_says_it_once(monkeypatch, saved, capsys):
    from draftforge.splitserve.config import GenerationConfig

    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    target = SGLangTarget(saved, LAYERS, TargetConfig(model=str(saved), dtype="float32"))
    eos = target.eos_token_ids()

    class Engine:
        def generate(self, input_ids, sampling_params):
            return [{"output_ids": [5, eos[0]], "meta_info": {"finish_reason": {"type": "stop"}}}
                    for _ in input_ids]

    target._engine = Engine()
    settings = GenerationConfig(temperature=0.7, top_k=20, top_p=0.8, max_new_tokens=4)
    for _ in range(2):
        target.generate([[{"role": "user", "content": "hi"}]], settings)
    assert capsys.readouterr().err.count("SGLang cuts both on the whole distribution") == 1
