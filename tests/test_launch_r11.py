"""Starting a job, round 11: a rank interrupted while it starts, and the dry run's figures
checked against independent counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- Ctrl-C at start-up

# A rank whose recipe loading is interrupted by a real SIGINT (a terminal's Ctrl-C reaches
# every rank of the job while they import torch, load the recipe or wait for their peers).
_INTERRUPTED_RANK = """
import os, runpy, signal, sys, time
import draftforge.config as config

# as started from a terminal: a suite run in the background ('make test &') hands its children
# SIGINT ignored, and the rank slept through the SIGINT below
signal.signal(signal.SIGINT, signal.default_int_handler)

def load_recipe(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)  # the KeyboardInterrupt lands here

config.load_recipe = load_recipe
sys.argv = ["draftforge.train", "recipes/tiny-debug.yaml"]
runpy.run_module("draftforge.train", run_name="__main__")
"""


def test_a_rank_interrupted_while_it_starts_says_so_in_one_line_and_exits_130():
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_RANK], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "[rank 1] interrupted", proc.stderr


# --------------------------------------------------------------------------- how to continue


def _checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("")
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_a_job_resumed_from_a_named_checkpoint_is_not_told_to_rerun_the_same_command(
        tmp_path, capsys, monkeypatch):
    """train.resume=PATH: after the run saved a later checkpoint the same command is refused
    (checkpoint.find_resume), so 'Rerun the same command to resume from the newest checkpoint'
    was wrong; train.resume=auto continues."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main
    from draftforge.train import checkpoint as ckpt

    recipe = tiny_recipe(tmp_path)
    start = _checkpoint(tmp_path / "run", 4)
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)

    def fails_after_a_checkpoint(*args, **kwargs):
        _checkpoint(tmp_path / "run", 8)
        return 1

    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", fails_after_a_checkpoint)
    assert train_main([str(recipe), f"train.resume={start}"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    # what the same command would meet now, and what train.resume=auto picks
    with pytest.raises(ckpt.CheckpointError, match="already holds checkpoints beyond step 4"):
        ckpt.find_resume(tmp_path / "run", str(start))
    assert ckpt.find_resume(tmp_path / "run", "auto").name == "step_00000008"
    assert last.endswith(  # the run saved step 8: the same command is refused now, and says so
        f"With train.resume={start} the same command is now refused ({tmp_path / 'run'} holds "
        f"step_00000008, later than where it would start); rerun with train.resume=auto in place of "
        f"'train.resume={start}' to continue "
        f"from {tmp_path / 'run' / 'checkpoints' / 'step_00000008'}."), last


# A rank that interrupts its launcher (this test's process) once, as Ctrl-C would, then waits.
_INTERRUPTING_RANK = (
    "import os, signal, time\n"
    "if os.environ['RANK'] == '0':\n"
    "    os.kill(os.getppid(), signal.SIGINT)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_stopped_job_says_how_to_continue_for_its_train_resume(resume, tmp_path, capsys,
                                                                 monkeypatch):
    """Ctrl-C: 'rerun the same command to continue from the newest checkpoint' holds for
    train.resume=auto only; with never the same command starts over, or is refused once
    the run has a checkpoint."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main
    from draftforge.splitserve.supervisor import JobInterrupted

    recipe = tiny_recipe(tmp_path)
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr("draftforge.splitserve.launch.rank_command",
                        lambda recipe, overrides: [sys.executable, "-c", _INTERRUPTING_RANK])
    with pytest.raises(JobInterrupted) as stop:
        train_main([str(recipe), f"train.resume={resume}"])
    assert stop.value.code == 128 + signal.SIGINT
    last = capsys.readouterr().err.splitlines()[-1]
    if resume == "auto":
        # the fake ranks wrote no checkpoint (a stop with one: tests/test_ckpt_r16.py)
        assert last == ("draftforge train: stopped on SIGINT; no checkpoint was written yet: the "
                        "same command starts over"), last
    else:
        assert last == (
            "draftforge train: stopped on SIGINT; with train.resume=never the same command starts "
            f"over (refused once {tmp_path / 'run'} holds a checkpoint); rerun with "
            "train.resume=auto in place of 'train.resume=never' to continue from the newest checkpoint "
            "instead."), last


# --------------------------------------------------------------------------- --master-addr


@pytest.mark.parametrize("address", ["", " ", "[]"])
def test_an_empty_master_addr_is_refused_before_anything_listens(address, tmp_path, capsys,
                                                                  monkeypatch):
    """--master-addr "$ADDR" with ADDR unset: the store was bound to '' (every interface,
    0.0.0.0) and the ranks retried connecting to '' until the store's 15-minute timeout."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve.launch import main as train_main

    recipe = tiny_recipe(tmp_path)
    started = []
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks",
                        lambda *a, **k: started.append(k["host"]) or 0)
    with pytest.raises(SystemExit) as refused:
        train_main([str(recipe), "--master-addr", address])
    assert refused.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert "argument --master-addr:" in err and "is no address" in err, err
    # brackets and spaces around a real address are still taken off
    assert train_main([str(recipe), "--master-addr", " [::1] "]) == 0 and started == ["::1"]


# --------------------------------------------------------------------------- the dry run's figures


def test_the_dry_runs_parameter_counts_are_a_built_drafts_and_a_hand_counts():
    """tiny-debug's draft: hidden 64, 1 layer, 4 heads / 2 KV heads of 16, MLP 128, 3 target
    layers of 64, vocabulary 49152, Markov rank 16, a confidence head with the Markov input."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import draft_parameter_counts
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config
    from draftforge.train.model import DSparkDraft

    cfg = load_recipe(ROOT / "recipes/tiny-debug.yaml", [])
    H, V, r, hd = 64, 49152, 16, 16
    layer = (H * 4 * hd + 2 * H * 2 * hd + 4 * hd * H  # q, k, v, o
             + 2 * hd + 2 * H  # q_norm, k_norm, the two layer norms
             + 3 * H * 128)  # gate, up, down
    trainable = 3 * H * H + 2 * H + layer + 2 * V * r + (H + r + 1)  # fc, norms, Markov, confidence
    frozen = 2 * V * H  # embed_tokens, lm_head
    model = DSparkDraft(build_dspark_config(cfg.draft, resolve_target_shape(cfg.target)))
    built = {id(p): p.numel() for p in model.parameters()}
    assert sum(built.values()) == trainable + frozen
    assert draft_parameter_counts(cfg) == (trainable + frozen, trainable)


def _items(estimate) -> dict[str, float]:
    return {name.split(" (")[0]: value for name, value in estimate.items}


def test_the_cpu_recipes_memory_estimate_by_hand():
    """recipes/smollm2-cpu.yaml in float32: SmolLM2-135M (30 layers, hidden 576, 9 heads, 3 KV
    heads of 64, MLP 1536, vocabulary 49152, 134,515,008 parameters), 5 captured layers."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import (
        draft_parameter_counts,
        target_estimate,
        trainer_estimate,
    )

    cfg = load_recipe(ROOT / "recipes/smollm2-cpu.yaml", ["target.dtype=float32", "train.dtype=float32"])
    seq, batch, wide = 320, 8, 6 * 576  # max_length, feature_batch_size, (5 + 1) x hidden
    target = _items(target_estimate(cfg))
    assert target["weights"] == 134_515_008 * 4
    assert target["features: captured layers"] == batch * seq * wide * 4
    assert target["features: one layer's activations"] == (
        batch * seq * (6 * 576 + 2 * 1536) * 4 + batch * 9 * seq * seq * 4)
    assert target["generation: KV cache + logits"] == (
        2 * 30 * 3 * 64 * 64 * (seq + 160) * 4 + 64 * 49152 * 4)  # generation batch 64, 160 new
    assert target["send buffers"] == 128 * seq * wide * 2  # 128 credits, bf16
    # split.reuse_features: two generation chunks of 64 rows, in the target's dtype
    assert target["features kept for epoch 1"] == 2 * 64 * seq * wide * 4
    with_emb, without = draft_parameter_counts(cfg)
    trainer = _items(trainer_estimate(cfg, with_emb, without))
    blocks = (1024 // seq) * 32 * 8  # 3 samples a micro-batch, 32 anchors each, blocks of 8
    assert trainer["trainable params"] == without * 4
    assert trainer["frozen embed + lm_head"] == 2 * 49152 * 576 * 4
    assert trainer["gradients"] == without * 4 and trainer["AdamW moments"] == without * 8
    assert trainer["batch features"] == 1024 * wide * 2
    # float32, sdpa (GQA 9/3 repeated to 9 heads of 64, a dense mask per row), 2 layers, 3 rows
    # of 320 context tokens (960) and 768 block tokens: splitserve/draft_activations.py's terms
    ctx = 3 * seq
    per_layer = (blocks * (4 * 1536 + 5 * 576 + 4 * 576 + 2 * 192) + 2 * ctx * 192
                 + 2 * (ctx + blocks) * 576 + blocks * (ctx + blocks) // 3)
    # fc's input (5 layers of 576) and output, hidden_norm's scaled context and its output, the
    # block's embeddings, the final norm's input and scaled values, rotary cos and sin (head 64)
    outside = ctx * 5 * 576 + 3 * ctx * 576 + 3 * blocks * 576 + 2 * (ctx + blocks) * 64
    assert trainer["context + backbone activations"] == 4 * (2 * per_layer + outside)
    assert trainer["objective chunk"] == 8 * 8 * 49152 * 16  # chunk_blocks 8 of 8 tokens
    assert trainer["received queue"] == 128 * seq * wide * 2


def test_the_ling_recipes_trainer_estimate_by_hand():
    """recipes/ling3-flash-dspark.yaml: 4 FSDP2 trainer ranks, bf16, the published draft of
    1,363,707,905 parameters (804,782,080 of them the frozen embedding and lm_head)."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.dry_run import trainer_estimate

    cfg = load_recipe(ROOT / "recipes/ling3-flash-dspark.yaml", [])
    frozen = 2 * 157_184 * 2560
    trainable = 1_363_707_905 - frozen
    wide = 6 * 2560
    trainer = _items(trainer_estimate(cfg, 1_363_707_905, trainable))
    assert trainer["trainable params"] == trainable * 4 / 4
    # FSDP2's units (r36): two layers of 89,134,336 gathered at once, and the root's own
    # 113,254,145 (fc, norms, Markov and confidence heads), bf16; not trainable / 5 a layer
    assert trainer["gathered layers"] == 2 * 89_134_336 * 2
    assert trainer["gathered root"] == 113_254_145 * 2
    # the frozen matrices whole on every trainer in bf16 (r49: no fp32 shard, no gathered copy)
    assert trainer["frozen embed + lm_head"] == frozen * 2
    assert "gathered embed + lm_head" not in trainer
    assert trainer["gradients"] == trainable * 4 / 4 and trainer["AdamW moments"] == trainable * 8 / 4
    assert trainer["batch features"] == 8192 * wide * 2
    # one sample of 8192 tokens a micro-batch: 512 anchors x 8 block tokens
    # bf16 parameters (FSDP2), flex attention (32 key/value heads of 128 kept as they are, no
    # dense mask), 5 layers: splitserve/draft_activations.py's terms, fp32 norm upcasts and the rest in bf16
    block, ctx = 512 * 8, 8192
    fp32 = block * (3 * 2560 // 2 + 4096 + 4096) + ctx * 4096
    bf16 = (block * (4 * 6144 + 7 * 2560 // 2 + 3 * 4096 + 4096) + ctx * 4096
              + 2 * (ctx + block) * 4096)
    outside = 2 * (ctx * 5 * 2560 + 2 * ctx * 2560 + 3 * block * 2560)
    assert trainer["context + backbone activations"] == 5 * (4 * fp32 + 2 * bf16) + outside
    assert trainer["objective chunk"] == 32 * 8 * 157_184 * 16
    assert trainer["received queue"] == 4 * 8192 * wide * 2  # 4 credits


def test_a_rank_started_without_torchrun_says_how_to_start_it_not_invalid_recipe(monkeypatch, capsys):
    """``python -m draftforge.train RECIPE`` without RANK/WORLD_SIZE: a launch mistake, which
    was printed under "invalid recipe:" though the recipe was fine."""
    from draftforge.train.__main__ import main as rank_main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml")
    assert rank_main([recipe]) == 2
    err = capsys.readouterr().err
    assert "invalid recipe" not in err
    assert ("draftforge train: error: no RANK and WORLD_SIZE in the environment: draftforge.train runs "
            "one rank of a split job; start it with 'draftforge train RECIPE'") in err


def test_a_hand_started_torchrun_with_another_per_node_count_is_refused():
    """torchrun's --nproc_per_node was never compared with the split's world_size / num_nodes:
    with 8 per node where the two-node recipe runs 8, fine; 4 or 16 refused, saying what to give."""
    from draftforge.config import load_recipe
    from draftforge.errors import InputError
    from draftforge.splitserve.roles import check_local_world

    cfg = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "ling3-flash-2node.yaml")
    check_local_world(cfg, "8")
    check_local_world(cfg, None)  # not under torchrun: RANK/WORLD_SIZE checks apply
    for wrong in ("4", "16"):
        with pytest.raises(InputError, match=rf"this node runs {wrong} processes \(torchrun --nproc_per_node\), "
                                             r"but the split runs 8 on each of its 2 node\(s\) \(split.world_size "
                                             r"16 / split.num_nodes 2\); start it with --nproc_per_node=8"):
            check_local_world(cfg, wrong)
