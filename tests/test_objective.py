"""The acceptance-aware objective against an independent, slow per-slot reference."""

from __future__ import annotations

import math

import pytest
import torch
from dspark_helpers import random_batch, tiny_draft

from draftforge.train.blocks import build_layout, sample_anchors
from draftforge.train.objective import dspark_objective


def reference_loss(model, hidden, prev, labels, valid, target_hidden, *, weighting="exp", decay=4.0,
                   ce_weight=0.1, tv_weight=0.9, bce_weight=1.0, kl_weight=0.0):
    """Slot by slot in float64, written from the contract's formulas, nothing shared with the code."""
    params = {n: p.double() for n, p in model.named_parameters()}
    lm = params["lm_head.weight"]
    head_type = model.config.markov_head_type
    rank = model.config.markov_rank
    num_blocks, block_size = labels.shape
    num = {"ce": 0.0, "tv": 0.0, "bce": 0.0, "kl": 0.0}
    den = 0.0
    for n in range(num_blocks):
        state = torch.zeros(rank, dtype=torch.float64)
        reach = 1.0
        still_valid = True
        for k in range(block_size):
            h = hidden[n, k].double()
            logits = lm @ h
            emb = None
            if rank:
                emb = params["markov_head.markov_w1.weight"][prev[n, k]]
                if head_type == "vanilla":
                    latent = emb
                elif head_type == "gated":
                    g = params["markov_head.gate_proj.weight"] @ torch.cat([h, emb]) + params["markov_head.gate_proj.bias"]
                    latent = torch.sigmoid(g) * emb
                else:
                    j = params["markov_head.joint_proj.weight"] @ torch.cat([state, emb, h]) + params["markov_head.joint_proj.bias"]
                    gate, cand, out = j[:rank], j[rank : 2 * rank], j[2 * rank :]
                    state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                    latent = torch.tanh(out)
                logits = logits + params["markov_head.markov_w2.weight"] @ latent
            p_d = torch.softmax(logits, 0)
            p_t = torch.softmax(lm @ target_hidden[n, k].double(), 0)
            l1 = (p_d - p_t).abs().sum()
            c = min(max(1.0 - 0.5 * float(l1.detach()), 0.0), 1.0)
            still_valid = still_valid and bool(valid[n, k])
            if weighting == "exp":
                w = math.exp(-k / decay) if still_valid else 0.0
            else:
                w = reach if still_valid else 0.0
            reach *= c
            if w == 0.0:
                continue
            ce = -torch.log(p_d[labels[n, k]])
            conf_in = torch.cat([h, emb]) if model.config.confidence_head_with_markov else h
            z = params["confidence_head.proj.weight"][0] @ conf_in + params["confidence_head.proj.bias"][0]
            bce = -(c * torch.log(torch.sigmoid(z)) + (1 - c) * torch.log(1 - torch.sigmoid(z)))
            num["ce"] = num["ce"] + w * ce
            num["tv"] = num["tv"] + w * l1
            num["bce"] = num["bce"] + w * bce
            num["kl"] = num["kl"] + w * sum(float(p_t[v]) * (math.log(float(p_t[v])) - torch.log(p_d[v]))
                                           for v in range(len(p_t)))
            den += w
    loss = (ce_weight * num["ce"] + tv_weight * num["tv"] + bce_weight * num["bce"]
            + kl_weight * num["kl"]) / den
    return loss, {k: float(v) / den for k, v in num.items()}


def _inputs(model, seed=0, num_anchors=7):
    cfg = model.config
    input_ids, loss_mask, aux, final = random_batch(cfg, seed=seed)
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator=torch.Generator().manual_seed(seed))
    layout = build_layout(input_ids, loss_mask, anchors, valid, cfg.block_size)
    torch.manual_seed(seed)
    hidden = torch.randn(*layout.labels.shape, cfg.hidden_size).flatten(0, 1)
    # Sharpen some target states so c* spans (0, 1) and the clamp at 0 is reached too.
    target_hidden = torch.randn(*layout.labels.shape, cfg.target_hidden_size).flatten(0, 1) * 2
    target_hidden[: hidden.shape[0] // 2] = hidden[: hidden.shape[0] // 2] + 0.05 * target_hidden[: hidden.shape[0] // 2]
    return (
        hidden,
        layout.prev_tokens.flatten(0, 1),
        layout.labels.flatten(0, 1),
        layout.valid.flatten(0, 1),
        target_hidden,
    )


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_objective_matches_slow_reference(head_type, weighting):
    model = tiny_draft(markov_head_type=head_type)
    hidden, prev, labels, valid, target_hidden = _inputs(model)
    assert valid.any() and not valid.all()
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden,
                           position_weighting=weighting, decay=3.0, chunk_blocks=4)
    ref, parts = reference_loss(model, hidden, prev, labels, valid, target_hidden,
                                weighting=weighting, decay=3.0)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert out.ce.item() == pytest.approx(parts["ce"], rel=1e-5)
    assert out.tv.item() == pytest.approx(parts["tv"], rel=1e-5)
    assert out.bce.item() == pytest.approx(parts["bce"], rel=1e-5)


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_objective_gradients_match_reference_autograd(head_type):
    """The fused analytic vocabulary gradients against autograd through the float64 reference."""
    model = tiny_draft(markov_head_type=head_type)
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=2)
    hidden = hidden.requires_grad_()
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=3)
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fused["hidden"] = hidden.grad.clone()
    model.zero_grad()
    hidden.grad = None
    ref, _ = reference_loss(model, hidden, prev, labels, valid, target_hidden)
    ref.backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected["hidden"] = hidden.grad
    assert set(fused) == set(expected) and "markov_head.markov_w2.weight" in fused
    for name in expected:
        torch.testing.assert_close(fused[name], expected[name].to(fused[name].dtype), rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_chunked_equals_unchunked(weighting):
    model = tiny_draft(markov_head_type="gated")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=5, num_anchors=9)
    results = []
    for chunked, chunk_blocks in ((False, 0), (True, 1), (True, 5), (True, 10_000)):
        model.zero_grad()
        h = hidden.clone().requires_grad_()
        out = dspark_objective(model, h, prev, labels, valid, target_hidden, chunked=chunked,
                               chunk_blocks=chunk_blocks or 1, position_weighting=weighting)
        out.loss.backward()
        grads = [h.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out.loss.detach(), out.c_star, grads))
    base_loss, base_c, base_grads = results[0]
    for loss, c_star, grads in results[1:]:
        torch.testing.assert_close(loss, base_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_star, base_c, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, base_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_denominator_is_reduced_across_ranks():
    model = tiny_draft()
    hidden, prev, labels, valid, target_hidden = _inputs(model)
    local = dspark_objective(model, hidden, prev, labels, valid, target_hidden)
    # Pretend three ranks hold the same weight: the global denominator triples.
    tripled = dspark_objective(model, hidden, prev, labels, valid, target_hidden,
                               reduce_sum=lambda t: t * 3)
    torch.testing.assert_close(tripled.loss * 3, local.loss)


def test_metrics_by_hand():
    from draftforge.train.objective import ObjectiveOutput

    c = torch.tensor([[0.5, 0.5, 1.0], [1.0, 0.2, 0.0], [0.9, 0.9, 0.9]])
    valid = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    out = ObjectiveOutput(torch.tensor(0.0), *(torch.tensor(0.0),) * 3, c * valid, valid.float(), valid)
    # block 0: 1 + .5 + .25 + .25 = 2.0; block 1: 1 + 1 + .2 + 0 = 2.2; block 2 has no valid slot.
    assert out.expected_acceptance_length().item() == pytest.approx(2.1)
    torch.testing.assert_close(out.slot_acceptance(), torch.tensor([0.75, 0.35, 1.0]))


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_compiled_objective_matches_reference_values_and_gradients(weighting, monkeypatch):
    """compile=True (torch.compile of the chunks' elementwise work, last chunk padded) against
    autograd through the float64 reference: loss, c* and every gradient."""
    from draftforge.train import objective

    monkeypatch.setattr(objective, "_COMPILE_FAILED", None)
    model = tiny_draft(markov_head_type="vanilla")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=3)
    assert hidden.shape[0] % 4 != 0  # the last chunk is short: padded for the compiled kernel
    hidden = hidden.requires_grad_()
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=4,
                           position_weighting=weighting, compile=True)
    assert objective._COMPILE_FAILED is None, objective._COMPILE_FAILED  # the compiled kernel ran
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fused["hidden"] = hidden.grad.clone()
    model.zero_grad()
    hidden.grad = None
    ref, parts = reference_loss(model, hidden, prev, labels, valid, target_hidden, weighting=weighting)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert out.tv.item() == pytest.approx(parts["tv"], rel=1e-5)
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected["hidden"] = hidden.grad
    assert set(fused) == set(expected) and "markov_head.markov_w2.weight" in fused
    for name in expected:
        torch.testing.assert_close(fused[name], expected[name].to(fused[name].dtype), rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_cached_vocabulary_head_follows_markov_and_lm_head_changes():
    """The CPU cache of [lm_head, W2] must never serve stale columns: after an optimizer-like
    change of W2 and an in-place reload of lm_head, the loss still equals the reference."""
    model = tiny_draft(markov_head_type="vanilla")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=4)
    for change in ("none", "w2", "lm_head"):
        with torch.no_grad():
            if change == "w2":
                model.markov_head.markov_w2.weight.add_(0.5)
            elif change == "lm_head":
                model.lm_head.weight.copy_(torch.randn_like(model.lm_head.weight))
        out = dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=4)
        ref, _ = reference_loss(model, hidden, prev, labels, valid, target_hidden)
        torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, change=change: f"after changing {change}: {m}")


def test_compile_failure_falls_back_to_eager_with_one_message(monkeypatch, capsys):
    """No C++ compiler (simulated): the run goes on eagerly with the same loss, and says so once."""
    from draftforge.train import objective

    def broken():
        def kernel(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return kernel

    monkeypatch.setattr(objective, "compiled_chunk_terms", broken)
    monkeypatch.setattr(objective, "_COMPILE_FAILED", None)
    model = tiny_draft(markov_head_type="vanilla")
    inputs = _inputs(model, seed=6)
    eager = dspark_objective(model, *inputs, chunk_blocks=4, compile=False).loss
    for _ in range(2):
        fallback = dspark_objective(model, *inputs, chunk_blocks=4, compile=True).loss
        torch.testing.assert_close(fallback, eager)
    err = capsys.readouterr().err
    assert err.count("torch.compile of the objective failed") == 1
    assert "InvalidCxxCompiler: No working C++ compiler found" in err


def test_out_of_memory_and_errors_after_compiling_propagate(monkeypatch, capsys):
    """Only a failure of the compiling (first) call falls back to eager: an out-of-memory error
    is the run's at any call, and an error of a kernel that has run is not a compile failure."""
    from draftforge.train import objective

    calls = []

    def kernel(*args):
        calls.append(len(calls))
        if failure[0] is not None:
            raise failure[0]
        return objective.chunk_terms(*args)

    monkeypatch.setattr(objective, "_COMPILED_CHUNK_TERMS", kernel)
    monkeypatch.setattr(objective, "_COMPILE_FAILED", None)
    monkeypatch.setattr(objective, "_KERNEL_THAT_RAN", None)
    model = tiny_draft(markov_head_type="vanilla")
    inputs = _inputs(model, seed=6)
    failure = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")]
    for _ in range(2):  # on the first call too: eager would need the same memory
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            dspark_objective(model, *inputs, chunk_blocks=4, compile=True)
    wrapped = RuntimeError("backend compiler failed")
    wrapped.__cause__ = torch.OutOfMemoryError("out of memory while autotuning")
    failure[0] = wrapped
    with pytest.raises(RuntimeError, match="backend compiler failed"):
        dspark_objective(model, *inputs, chunk_blocks=4, compile=True)
    failure[0] = None
    eager = dspark_objective(model, *inputs, chunk_blocks=4, compile=False).loss
    torch.testing.assert_close(dspark_objective(model, *inputs, chunk_blocks=4, compile=True).loss, eager)
    failure[0] = RuntimeError("device-side assert triggered")  # after the kernel has run
    with pytest.raises(RuntimeError, match="device-side assert"):
        dspark_objective(model, *inputs, chunk_blocks=4, compile=True)
    assert objective._COMPILE_FAILED is None and objective._KERNEL_THAT_RAN is kernel
    assert "torch.compile of the objective failed" not in capsys.readouterr().err


def test_an_error_of_the_inputs_is_not_blamed_on_the_compiler(monkeypatch, capsys):
    """A first call that fails because of its inputs (a label past the vocabulary) fails eagerly
    too: that error propagates alone, compilation stays on, and no compile failure is printed."""
    from draftforge.train import objective

    def kernel(*args):  # stands in for the compiled kernel: the inputs' error surfaces the same way
        return objective.chunk_terms(*args)

    monkeypatch.setattr(objective, "_COMPILED_CHUNK_TERMS", kernel)
    monkeypatch.setattr(objective, "_COMPILE_FAILED", None)
    monkeypatch.setattr(objective, "_KERNEL_THAT_RAN", None)
    model = tiny_draft(markov_head_type="vanilla")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=6)
    labels = labels.clone()
    labels[valid] = model.config.vocab_size + 3
    with pytest.raises((IndexError, RuntimeError)) as caught:
        dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=4, compile=True)
    assert caught.value.__context__ is None  # not raised while handling the compiled kernel's error
    assert objective._COMPILE_FAILED is None and objective._KERNEL_THAT_RAN is None
    assert "torch.compile of the objective failed" not in capsys.readouterr().err


@pytest.mark.parametrize("compiled", [False, True])
def test_kl_term_matches_the_reference_in_value_and_gradients(compiled, monkeypatch):
    """train.loss.kl_weight: KL(p_t || p_d) summed token by token in the float64 reference,
    against the fused analytic gradient (d/dlogits = p_d - p_t), eager and compiled."""
    from draftforge.train import objective

    monkeypatch.setattr(objective, "_COMPILE_FAILED", None)
    model = tiny_draft(markov_head_type="vanilla")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=6)
    hidden = hidden.requires_grad_()
    out = dspark_objective(model, hidden, prev, labels, valid, target_hidden, chunk_blocks=4,
                           kl_weight=0.7, compile=compiled)
    assert objective._COMPILE_FAILED is None, objective._COMPILE_FAILED  # compiled: the kernel ran
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    fused["hidden"] = hidden.grad.clone()
    model.zero_grad()
    hidden.grad = None
    ref, parts = reference_loss(model, hidden, prev, labels, valid, target_hidden, kl_weight=0.7)
    ref.backward()
    assert parts["kl"] > 0.1
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert out.kl.item() == pytest.approx(parts["kl"], rel=1e-5)
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected["hidden"] = hidden.grad
    for name in expected:
        torch.testing.assert_close(fused[name], expected[name].to(fused[name].dtype), rtol=1e-4,
                                   atol=1e-6, msg=name)
    # the plain autograd path agrees too
    unchunked = dspark_objective(model, hidden.detach(), prev, labels, valid, target_hidden,
                                 chunked=False, kl_weight=0.7)
    torch.testing.assert_close(unchunked.loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert unchunked.kl.item() == pytest.approx(parts["kl"], rel=1e-5)



def _bf16_vocab_inputs(seed=7):
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block_size, width, rank, vocab = 10, 4, 32, 8, 64

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).bfloat16()

    hidden, latent = randn(num_blocks, block_size, width), randn(num_blocks, block_size, rank)
    markov_w2, lm_head = randn(vocab, rank, scale=0.3), randn(vocab, width, scale=0.3)
    target_hidden = hidden + randn(num_blocks, block_size, width, scale=0.3)
    labels = torch.randint(0, vocab, (num_blocks, block_size), generator=generator)
    valid = torch.ones(num_blocks, block_size, dtype=torch.bool)
    return hidden, latent, markov_w2, lm_head, target_hidden, labels, valid


def test_bf16_input_gradients_are_scaled_in_fp32():
    """The loss divided by a denominator bf16 cannot hold (13): the fused input gradients are
    the x1 run's divided in fp32 and rounded to bf16 once, not scaled by a bf16-rounded 1/13
    (0.3 % off, the whole backbone's gradient under FSDP2 bf16 parameters)."""
    from draftforge.train.objective import exp_weights, vocab_terms

    def grads(denominator):
        hidden, latent, markov_w2, lm_head, target_hidden, labels, valid = _bf16_vocab_inputs()
        leaves = [x.requires_grad_() for x in (hidden, latent, markov_w2)]
        total = vocab_terms(hidden, latent, markov_w2, lm_head, target_hidden, labels, valid,
                            exp_weights(valid, 4.0), ce_weight=0.1, tv_weight=0.9, chunk_blocks=3,
                            dpace=False)[0]
        (total / torch.tensor(denominator)).backward()
        return [x.grad for x in leaves]

    once, scaled = grads(1.0), grads(13.0)
    for name, unit, got in zip(("hidden", "latent", "markov_w2"), once, scaled, strict=True):
        assert got.dtype == torch.bfloat16 and unit.abs().max() > 0
        want = unit.float() / 13.0
        # elementwise: one bf16 rounding of the final product (W2's x1 gradient, kept in fp32
        # until then, is itself rounded once more here)
        rtol = 2**-7 if name == "markov_w2" else 2**-8
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=0, msg=name)
        # as a whole: the scale is 1/13, not bf16(1/13) = (1/13)(1 + 0.0029)
        ratio = float((got.float() * want).sum() / (want * want).sum())
        assert ratio == pytest.approx(1.0, abs=5e-4), name


def test_no_grad_skips_the_gradient_work_and_keeps_the_values():
    """Under torch.no_grad() (eval) the chunks compute the loss only: two vocabulary-sized
    matmuls per chunk instead of three per chunk and W2's gradient (one product for the
    whole group of chunks here), the same sums, c* and weights."""
    from torch.overrides import TorchFunctionMode

    model = tiny_draft(markov_head_type="vanilla")
    hidden, prev, labels, valid, target_hidden = _inputs(model, seed=8)
    vocab = model.config.vocab_size

    class CountVocabMatmuls(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and any(
                    vocab in getattr(a, "shape", ()) for a in args):
                CountVocabMatmuls.count += 1
            return func(*args, **(kwargs or {}))

    def run(grad_enabled):
        CountVocabMatmuls.count = 0
        with torch.set_grad_enabled(grad_enabled), CountVocabMatmuls():
            out = dspark_objective(model, hidden.clone().requires_grad_(), prev, labels, valid,
                                   target_hidden, chunk_blocks=4, position_weighting="dpace")
        return out, CountVocabMatmuls.count

    (with_grad, count_grad), (without, count_no_grad) = run(True), run(False)
    num_chunks = -(-hidden.shape[0] // 4)
    assert count_grad == 3 * num_chunks + 1 and count_no_grad == 2 * num_chunks
    assert with_grad.loss.requires_grad and not without.loss.requires_grad
    for name in ("loss", "ce", "tv", "bce", "c_star", "weights"):
        torch.testing.assert_close(getattr(without, name), getattr(with_grad, name).detach(),
                                   rtol=0, atol=0, msg=name)
