"""FSDP2's full state for checkpoints and export: gathered one tensor at a time."""

from __future__ import annotations

import json

from trainer_helpers import fsdp2_layout_worker, full_state_worker


def test_the_full_state_is_gathered_one_tensor_at_a_time_and_kept_on_rank_zero_only(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(full_state_worker, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    main = json.loads((tmp_path / "result.0").read_text())
    other = json.loads((tmp_path / "result.1").read_text())
    names = sorted(["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias", "scale"])
    # rank 0: every tensor, equal to the module before sharding, and a copy of it
    assert main["keys"] == names and sorted(main["equal"]) == names
    assert main["untouched"]
    # rank 1 joined the same gathers and kept nothing: never more than one gathered tensor alive
    assert other["keys"] == [] and other["untouched"]
    assert other["most_alive"] == 1
    # rank 0 keeps them (on CPU here, the same tensors; on a GPU, copies while the device one goes)
    assert main["most_alive"] == 6


def test_fsdp2_leaves_the_frozen_embedding_and_lm_head_whole_in_bf16(tmp_path):
    """Sharded, they kept an fp32 shard on every rank and were all-gathered again at every
    micro-batch's forward; they are frozen, so every rank now holds them whole, as bf16."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(fsdp2_layout_worker, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"result.{rank}").read_text())
        layout = result["layout"]
        frozen = {name for name, (_, _, trainable) in layout.items() if not trainable}
        assert frozen == {"embed_tokens.weight", "lm_head.weight"}
        assert all(layout[name][:2] == [False, "bfloat16"] for name in frozen), layout
        assert result["frozen_equal"]  # the target's matrices, rounded once, on every rank
        # the trainable weights are fp32 master shards
        assert all(layout[name][:2] == [True, "float32"] for name in layout if name not in frozen), layout
        assert result["full_dtypes"]["lm_head.weight"] == "bfloat16"
        assert result["full_dtypes"]["fc.weight"] == "float32"


def test_the_full_state_of_a_one_rank_mesh_is_a_copy_of_the_live_weights(tmp_path):
    """On one rank DTensor.full_tensor() returns the local shard itself: the state aliased the
    fp32 masters, and the next optimizer step changed what the caller held."""
    import torch.multiprocessing as mp
    from trainer_helpers import full_state_one_rank_worker

    out = str(tmp_path / "result")
    mp.spawn(full_state_one_rank_worker, args=(1, f"file://{tmp_path / 'store'}", out), nprocs=1, join=True)
    assert json.loads((tmp_path / "result.0").read_text()) == {"unchanged": True}
