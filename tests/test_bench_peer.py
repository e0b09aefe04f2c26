"""``draftforge bench peer``: options, the missing-SpecForge message, the rate arithmetic, and
(only where SpecForge is importable) SpecForge's own step at a tiny shape."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.train import bench_peer
from draftforge.train.bench_peer import (
    anchors_per_step,
    find_specforge,
    parse_args,
    step_schedule,
    summary_line,
    tokens_per_second,
)


def _specforge_root() -> str | None:
    """An unpacked SpecForge wheel: $SPECFORGE_PATH, or an installed specforge (None: neither)."""
    path = os.environ.get("SPECFORGE_PATH")
    if path and os.path.isfile(os.path.join(path, "specforge", "__init__.py")):
        return path
    spec = importlib.util.find_spec("specforge")
    return None if spec is None or spec.origin is None else os.path.dirname(os.path.dirname(spec.origin))


SPECFORGE_ROOT = _specforge_root()


@pytest.fixture
def no_specforge(monkeypatch):
    """A process in which ``import specforge`` finds nothing."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "specforge" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "specforge", raising=False)


def test_defaults_are_the_issue_shape_of_the_run():
    args = parse_args([])
    assert (args.seq, args.anchors, args.batch, args.threads, args.chunk_blocks) == (512, 64, 1, 2, 64)
    assert args.specforge_path is None and args.steps >= 3 and args.rounds == 1 and not args.interleave


@pytest.mark.parametrize("argv, named", [
    (["--anchors", "0"], "--anchors"), (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--seq", "8"], "--seq"), (["--rounds", "0"], "--rounds"), (["--chunk-blocks", "0"], "--chunk-blocks"),
])
def test_bad_options_exit_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_missing_specforge_exits_2_with_the_download_command(no_specforge, capsys):
    assert cli_main(["bench", "peer"]) == 2
    err = capsys.readouterr().err
    assert "SpecForge is not importable" in err
    assert "pip download specforge==0.2.0 --no-deps -d /tmp/specforge" in err
    assert "python -m zipfile -e /tmp/specforge/specforge-0.2.0-py3-none-any.whl /tmp/specforge/src" in err
    assert "--specforge-path /tmp/specforge/src" in err


def test_a_specforge_path_without_the_package_is_refused(tmp_path, capsys):
    assert bench_peer.main(["--specforge-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--specforge-path {tmp_path}" in err and "specforge/__init__.py" in err
    assert str(tmp_path) not in sys.path


def test_a_specforge_path_goes_first_on_sys_path(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "specforge", raising=False)
    (tmp_path / "specforge").mkdir()
    (tmp_path / "specforge" / "__init__.py").write_text("")
    assert find_specforge(str(tmp_path)) is None
    assert sys.path[0] == str(tmp_path)
    assert importlib.util.find_spec("specforge").origin == str(tmp_path / "specforge" / "__init__.py")


def test_tokens_per_second_and_the_last_line():
    # 64 anchors x block 8 = 512 tokens; a 1.85 s step is the issue's ~277 tokens/s.
    assert tokens_per_second(num_anchors=64, block_size=8, step_s=1.85) == pytest.approx(276.76, abs=0.01)
    assert tokens_per_second(num_anchors=64, block_size=8, step_s=0.5) == 1024.0
    line = summary_line(peer_tokens_s=512 / 1.85, draftforge_tokens_s=512 / 0.5)
    assert line == "peer_tokens_s=276.8 draftforge_tokens_s=1024.0 speedup=3.70"
    with pytest.raises(ValueError, match="positive"):
        tokens_per_second(num_anchors=64, block_size=8, step_s=0.0)


def test_step_schedule_orders_the_two_sides():
    assert step_schedule(2, interleave=False) == ["SpecForge", "SpecForge", "draftforge", "draftforge"]
    assert step_schedule(2, interleave=True) == ["SpecForge", "draftforge", "SpecForge", "draftforge"]


def test_anchors_per_step_counts_what_both_samplers_can_draw():
    # Anchor candidates: p with mask[p] and mask[p + 1]. Row 0 has 5 (positions 2..6 of 0..7
    # supervised from 2 on), row 1 has 2 (3-4, 6-7).
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert anchors_per_step(mask, 64) == 5 + 2
    assert anchors_per_step(mask, 3) == 3 + 2
    assert anchors_per_step(mask.float(), 1) == 2


@pytest.mark.skipif(SPECFORGE_ROOT is None,
                    reason="SpecForge is not importable; set SPECFORGE_PATH to an unpacked specforge 0.2.0 "
                    "wheel (pip download specforge==0.2.0 --no-deps) to run it")
@pytest.mark.filterwarnings("ignore:To get the last learning rate")  # SpecForge's LR scheduler
def test_specforge_step_runs_at_a_tiny_shape_and_trains(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert find_specforge(SPECFORGE_ROOT) is None
    from draftforge.train.bench_train import _synthetic_samples
    from draftforge.train.model import DSparkConfig

    cfg = DSparkConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=48, target_hidden_size=32,
                       num_target_layers=6, target_layer_ids=[1, 3], block_size=4, mask_token_id=5,
                       markov_rank=8, enable_confidence_head=True, confidence_head_with_markov=True)
    args = parse_args(["--seq", "32", "--anchors", "3", "--steps", "1", "--warmup", "0", "--chunk-blocks", "2"])
    train_args = bench_peer._train_args(args)
    batch = bench_peer.specforge_batch(_synthetic_samples(cfg, train_args, torch.Generator().manual_seed(0)))
    assert batch.tensors["hidden_states"].shape == (1, 32, 2 * 32)
    model, step = bench_peer.build_specforge_step(cfg, args)
    # The peer draft has the shapes asked for: widths, Markov head and the confidence head on [h; W1].
    draft = model.draft_model
    assert draft.layers[0].self_attn.q_proj.weight.shape == (4 * 8, 32)
    assert draft.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    assert draft.fc.weight.shape == (32, 2 * 32)
    assert draft.markov_head.markov_w2.weight.shape == (96, 8)
    assert draft.confidence_head.proj.weight.shape == (1, 32 + 8)
    assert draft.config._attn_implementation == "sdpa" and model.num_anchors == 3
    before = draft.fc.weight.detach().clone()
    result = step(batch)
    assert torch.isfinite(torch.as_tensor(result.metrics["loss"]))
    assert not torch.equal(before, draft.fc.weight.detach())  # AdamW stepped the draft


def test_draftforges_side_of_the_round_steps_with_the_options_bench_peer_gives_it():
    """bench peer hands draftforge's trainer step bench train's options; they must build a
    trainer that steps (the device among them), without SpecForge installed."""
    from dspark_helpers import tiny_draft

    from draftforge.train.bench_train import train_steps

    args = parse_args(["--seq", "64", "--anchors", "4", "--steps", "1", "--warmup", "0", "--threads", "1"])
    train_args = bench_peer._train_args(args)
    assert train_args.device == "cpu"
    steps = train_steps(tiny_draft().config, None, train_args)
    seconds, loss, anchors = next(steps)
    steps.close()
    assert seconds > 0 and torch.isfinite(torch.tensor(loss)) and sum(len(a) for a in anchors) == 4
