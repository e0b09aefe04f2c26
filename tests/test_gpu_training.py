"""The training paths that only run on CUDA: the compiled objective, flex attention's
backward, the bf16 trainer step. Marked ``gpu``; skipped without a CUDA device.

Each CUDA result is compared with an independent computation on the CPU or with the
other attention backend (sdpa, a dense mask), not with itself.
"""

from __future__ import annotations

import pytest
import torch
from dspark_helpers import random_batch, tiny_draft

from draftforge.train.blocks import sample_anchors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _loss_and_grads(model, inputs, *, compile_objective):
    """The model's training loss on ``inputs`` and every parameter's gradient (float64, CPU)."""
    model.zero_grad()
    input_ids, loss_mask, aux, final, anchors, valid = inputs
    out = model(input_ids, loss_mask, aux, final, anchors, valid,
                objective={"chunk_blocks": 4, "compile": compile_objective})
    out.loss.backward()
    grads = {name: p.grad.detach().double().cpu() for name, p in model.named_parameters()
             if p.grad is not None}
    return out.loss.detach().double().cpu(), grads


def _inputs(cfg, seq_len, *, num_anchors=6, seed=1, device="cpu"):
    input_ids, loss_mask, aux, final = random_batch(cfg, seq_len=seq_len, seed=seed)
    anchors, valid = sample_anchors(loss_mask, num_anchors, torch.Generator().manual_seed(seed))
    return tuple(t.to(device) for t in (input_ids, loss_mask, aux, final, anchors, valid))


def _assert_grads_close(got, want, *, rtol, atol):
    assert set(got) == set(want) and "fc.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


def test_cuda_step_with_compiled_objective_matches_cpu_eager():
    """The whole packed forward, objective (compiled on CUDA: compile='auto') and backward
    against the same float32 model on the CPU with the eager objective."""
    cpu_model = tiny_draft()
    cuda_model = tiny_draft().cuda()
    inputs = _inputs(cpu_model.config, 48)
    want_loss, want = _loss_and_grads(cpu_model, inputs, compile_objective=False)
    got_loss, got = _loss_and_grads(cuda_model, tuple(t.cuda() for t in inputs),
                                    compile_objective="auto")
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
    _assert_grads_close(got, want, rtol=1e-3, atol=1e-5)


def test_flex_matches_sdpa_in_forward_and_backward_across_lengths():
    """flex attention (block mask, compiled) against sdpa (dense mask) on CUDA: the loss and
    every gradient, for batches of several lengths, as training sees them (a batch's length
    is its longest sequence). The compiled kernel is shape-generic: the new lengths add at
    most one recompilation, not one per length."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}  # head_dim 16: flex's CUDA minimum
    sdpa = tiny_draft(**heads).cuda()
    flex = tiny_draft(attention_backend="flex", **heads).cuda()
    flex.load_state_dict(sdpa.state_dict())
    graphs = []
    for seq_len in (40, 57, 64, 71, 96, 130, 200, 333):
        inputs = _inputs(sdpa.config, seq_len, seed=seq_len, device="cuda")
        want_loss, want = _loss_and_grads(sdpa, inputs, compile_objective=False)
        got_loss, got = _loss_and_grads(flex, inputs, compile_objective=False)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5, msg=f"length {seq_len}")
        _assert_grads_close(got, want, rtol=1e-3, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] - graphs[0] <= 1, f"flex attention recompiled per length: graphs {graphs}"


def test_bf16_trainer_step_on_cuda_lowers_the_loss():
    """The real Trainer (strategy single, bf16 autocast, AdamW) on CUDA: repeated steps on
    one synthetic batch lower the loss, and the parameters stay float32 masters."""
    import tempfile
    from pathlib import Path

    from dspark_helpers import tiny_config

    from draftforge.train.config import TrainConfig
    from draftforge.train.sample import Sample
    from draftforge.train.trainer import Trainer

    cfg = tiny_config()
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.3
    input_ids, loss_mask, aux, final = random_batch(cfg, seq_len=48)
    samples = [Sample(f"s{i}", input_ids[i], loss_mask[i], aux[i].bfloat16(), final[i].bfloat16())
               for i in range(input_ids.shape[0])]
    train = TrainConfig(strategy="single", dtype="bfloat16", device="cuda", num_anchors=6, steps=80,
                        lr=1e-2, warmup_ratio=0.0, resume="never")
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(model_config=cfg, train=train, embeddings=(embed, lm_head),
                          run_dir=Path(run_dir))
        losses = [trainer.train_step([samples])["loss"] for _ in range(80)]
        params = list(trainer.model.parameters())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    assert any(p.is_cuda for p in params)
    assert all(p.dtype == torch.float32 for p in params if p.requires_grad)


def test_flex_on_cuda_refuses_heads_below_its_minimum_with_the_way_out():
    """inductor's flex kernel refuses head_dim < 16 deep inside compilation; the draft says
    so first, naming the setting and the alternatives."""
    model = tiny_draft(attention_backend="flex").cuda()  # hidden 32 / 4 heads: head_dim 8
    with pytest.raises(ValueError, match="head_dim >= 16.*sdpa"):
        _loss_and_grads(model, _inputs(model.config, 40, device="cuda"), compile_objective=False)
