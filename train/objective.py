"""The acceptance-aware objective (contract section 2), computed in chunks of blocks.

Per slot k with cumulative validity m_k and weight w_k:

* ``CE  = sum w_k * -log p_d,k(x_{p+k+1}) / sum w_k``
* ``TV  = sum w_k * ||p_d,k - p_t,k||_1 / sum w_k``
* ``c*_k = clamp(1 - 0.5 * ||p_d,k - p_t,k||_1, 0, 1)`` (detached)
* ``BCE = sum w_k * BCEWithLogits(z_k, c*_k) / sum w_k``
* ``L = ce_weight * CE + tv_weight * TV + bce_weight * BCE``

Weights: ``exp`` gives ``w_k = m_k * exp(-k / decay)``; ``dpace`` gives
``w_k = m_k * prod_{i<k} c*_i`` (detached), the probability that slot k is
reached at all when the earlier slots are verified, so the loss spends its
weight where acceptance is decided. The denominator ``sum w_k`` is summed over
all ranks through ``reduce_sum``.

Vocabulary-sized tensors exist for one chunk of blocks at a time: the fused
function below computes the loss of a chunk and, in the same pass, its
gradient with respect to the chunk's hidden states, Markov latents and the
Markov output matrix (analytic softmax / L1 gradients), so backward never
recomputes or stores the vocabulary tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    bce: torch.Tensor
    c_star: torch.Tensor  # [N, γ], zero on invalid slots
    weights: torch.Tensor  # [N, γ]
    valid: torch.Tensor  # [N, γ]

    def slot_acceptance(self) -> torch.Tensor:
        """Mean c*_k over valid slots, per slot [γ] (NaN where a slot is never valid)."""
        valid = self.valid.float()
        return (self.c_star * valid).sum(0) / valid.sum(0)

    def expected_acceptance_length(self) -> torch.Tensor:
        """tau = 1 + sum_k prod_{i<=k} c*_i, averaged over blocks whose first slot is valid."""
        blocks = self.valid[:, 0]
        if not blocks.any():
            return torch.tensor(float("nan"))
        tau = 1.0 + torch.cumprod(self.c_star[blocks], dim=-1).sum(-1)
        return tau.mean()


def exp_weights(valid: torch.Tensor, decay: float) -> torch.Tensor:
    k = torch.arange(valid.shape[-1], device=valid.device, dtype=torch.float32)
    return valid.float() * torch.exp(-k / decay)


def dpace_weights(valid: torch.Tensor, c_star: torch.Tensor) -> torch.Tensor:
    reach = torch.cumprod(torch.cat([torch.ones_like(c_star[:, :1]), c_star[:, :-1]], dim=-1), dim=-1)
    return valid.float() * reach


class _FusedVocabLoss(torch.autograd.Function):
    """Chunked CE + TV over the vocabulary with gradients computed in the forward pass.

    Returns ``(ce_weight * sum w*CE + tv_weight * sum w*TV, sum w*CE, sum w*TV, c*, w)``;
    only the first output carries a gradient.
    """

    @staticmethod
    def forward(ctx, hidden, latent, markov_w2, lm_head, target_hidden, labels, valid,
                base_weights, ce_weight: float, tv_weight: float, chunk_blocks: int, dpace: bool):
        num_blocks, block_size, _ = hidden.shape
        dtype = lm_head.dtype
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_latent = None if latent is None else torch.empty_like(latent)
        grad_w2 = None if latent is None else torch.zeros_like(markov_w2, dtype=torch.float32)
        c_star = torch.zeros(num_blocks, block_size, dtype=torch.float32, device=hidden.device)
        weights = torch.zeros_like(c_star)
        sum_ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        sum_tv = torch.zeros_like(sum_ce)
        for start in range(0, num_blocks, chunk_blocks):
            sl = slice(start, min(start + chunk_blocks, num_blocks))
            h = hidden[sl].to(dtype)
            probs = (h @ lm_head.t()).float()
            if latent is not None:
                lat = latent[sl].to(dtype)
                probs += (lat @ markov_w2.t()).float()
            # CE needs log p_d at the label only; softmax then happens in place.
            label_logit = probs.gather(-1, labels[sl].unsqueeze(-1)).squeeze(-1)
            lse = torch.logsumexp(probs, dim=-1)
            ce = lse - label_logit
            probs.sub_(lse.unsqueeze(-1)).exp_()
            # softmax upcasts inside the kernel; the L1 norm avoids an |diff| temporary.
            diff = torch.softmax(target_hidden[sl].to(dtype) @ lm_head.t(), dim=-1, dtype=torch.float32)
            torch.sub(probs, diff, out=diff)
            tv = torch.linalg.vector_norm(diff, 1, dim=-1)
            c = (1.0 - 0.5 * tv).clamp_(0.0, 1.0) * valid[sl]
            w = dpace_weights(valid[sl], c) if dpace else base_weights[sl]
            c_star[sl], weights[sl] = c, w
            sum_ce += (w * ce).sum()
            sum_tv += (w * tv).sum()
            # d/dlogits: CE -> w (p - onehot); L1 -> w p (s - <s, p>) with s = sign(p_d - p_t).
            grad = diff.sign_()
            s_dot_p = (grad.unsqueeze(-2) @ probs.unsqueeze(-1))[..., 0, 0]  # <s, p> as a batched matmul
            grad.sub_(s_dot_p.unsqueeze(-1)).mul_((tv_weight * w).unsqueeze(-1))
            grad.add_((ce_weight * w).unsqueeze(-1)).mul_(probs)
            del probs
            grad.scatter_add_(-1, labels[sl].unsqueeze(-1), (-ce_weight * w).unsqueeze(-1))
            grad = grad.to(dtype)
            grad_hidden[sl] = (grad @ lm_head).to(hidden.dtype)
            if latent is not None:
                grad_latent[sl] = (grad @ markov_w2).to(latent.dtype)
                grad_w2 += (grad.flatten(0, 1).t() @ lat.flatten(0, 1)).float()
            del grad, diff
        ctx.save_for_backward(grad_hidden, grad_latent, grad_w2)
        ctx.has_latent = latent is not None
        ctx.w2_dtype = None if markov_w2 is None else markov_w2.dtype
        ctx.mark_non_differentiable(sum_ce, sum_tv, c_star, weights)
        total = ce_weight * sum_ce + tv_weight * sum_tv
        return total, sum_ce, sum_tv, c_star, weights

    @staticmethod
    def backward(ctx, grad_total, *unused):
        grad_hidden, grad_latent, grad_w2 = ctx.saved_tensors
        scale = grad_total
        out_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        out_latent = out_w2 = None
        if ctx.has_latent:
            out_latent = grad_latent * scale.to(grad_latent.dtype)
            out_w2 = (grad_w2 * scale).to(ctx.w2_dtype)
        return (out_hidden, out_latent, out_w2) + (None,) * 9


def vocab_terms(
    hidden, latent, markov_w2, lm_head, target_hidden, labels, valid, base_weights, *,
    ce_weight: float, tv_weight: float, chunk_blocks: int, dpace: bool,
):
    """CE/TV sums over all blocks, chunked; see :class:`_FusedVocabLoss`."""
    return _FusedVocabLoss.apply(
        hidden, latent, markov_w2, lm_head, target_hidden, labels, valid.float(), base_weights,
        float(ce_weight), float(tv_weight), int(chunk_blocks), bool(dpace),
    )


def vocab_terms_unchunked(
    hidden, latent, markov_w2, lm_head, target_hidden, labels, valid, base_weights, *,
    ce_weight: float, tv_weight: float, dpace: bool, **_unused,
):
    """The same sums through plain autograd on all blocks at once (memory baseline)."""
    logits = hidden.to(lm_head.dtype) @ lm_head.t()
    if latent is not None:
        logits = logits + latent.to(lm_head.dtype) @ markov_w2.t()
    logp = torch.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        target = torch.softmax((target_hidden.to(lm_head.dtype) @ lm_head.t()).float(), dim=-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    tv = (logp.exp() - target).abs().sum(-1)
    c_star = ((1.0 - 0.5 * tv.detach()).clamp(0.0, 1.0)) * valid.float()
    weights = dpace_weights(valid, c_star) if dpace else base_weights
    sum_ce, sum_tv = (weights * ce).sum(), (weights * tv).sum()
    total = ce_weight * sum_ce + tv_weight * sum_tv
    return total, sum_ce.detach(), sum_tv.detach(), c_star, weights


def dspark_objective(
    model,
    hidden: torch.Tensor,
    prev_tokens: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    target_hidden: torch.Tensor,
    *,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    bce_weight: float = 1.0,
    decay: float = 4.0,
    position_weighting: str = "exp",
    chunk_blocks: int = 64,
    chunked: bool = True,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ObjectiveOutput:
    """The loss of N blocks.

    hidden [N, γ, H] (post-norm draft states), prev_tokens / labels / valid [N, γ],
    target_hidden [N, γ, H_t] (the target's final post-norm state at p + k).
    ``reduce_sum`` sums the weight denominator over ranks (identity by default).
    """
    if position_weighting not in ("exp", "dpace"):
        raise ValueError(f"position_weighting {position_weighting!r} is not one of 'exp', 'dpace'")
    valid = valid.bool()
    latent = emb = None
    markov_w2 = None
    if model.markov_head is not None:
        latent, emb = model.markov_head.teacher_forced(prev_tokens, hidden)
        markov_w2 = model.markov_head.markov_w2.weight
    terms = vocab_terms if chunked else vocab_terms_unchunked
    total, sum_ce, sum_tv, c_star, weights = terms(
        hidden, latent, markov_w2, model.lm_head.weight, target_hidden, labels, valid,
        exp_weights(valid, decay), ce_weight=ce_weight, tv_weight=tv_weight,
        chunk_blocks=chunk_blocks, dpace=position_weighting == "dpace",
    )
    sum_bce = torch.zeros((), device=hidden.device)
    if model.confidence_head is not None:
        z = model.confidence_head(hidden, emb).float()
        bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
        sum_bce = (weights * bce).sum()
    denominator = weights.sum()
    if reduce_sum is not None:
        denominator = reduce_sum(denominator.detach().clone())
    denominator = denominator.clamp(min=1e-6)
    loss = (total + bce_weight * sum_bce) / denominator
    return ObjectiveOutput(
        loss=loss,
        ce=(sum_ce / denominator).detach(),
        tv=(sum_tv / denominator).detach(),
        bce=(sum_bce / denominator).detach(),
        c_star=c_star,
        weights=weights,
        valid=valid,
    )
