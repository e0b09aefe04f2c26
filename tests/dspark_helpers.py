"""Small builders shared by the draft-model tests."""

from __future__ import annotations

import torch

from draftforge.train.model import DSparkConfig, DSparkDraft


def tiny_config(**overrides) -> DSparkConfig:
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        target_hidden_size=32,
        num_target_layers=6,
        target_layer_ids=[0, 2, 4],
        block_size=4,
        mask_token_id=5,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    fields.update(overrides)
    return DSparkConfig(**fields)


def tiny_draft(seed: int = 0, dtype=torch.float32, **overrides) -> DSparkDraft:
    torch.manual_seed(seed)
    model = DSparkDraft(tiny_config(**overrides))
    cfg = model.config
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.3)
        # Non-trivial norms and Markov weights so every term is exercised.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        if model.markov_head is not None:
            model.markov_head.markov_w2.weight.normal_(0, 0.3)
            model.markov_head.markov_w1.weight.normal_(0, 1.0)
    assert cfg.vocab_size == 64
    return model.to(dtype)


def random_batch(cfg: DSparkConfig, batch: int = 2, seq_len: int = 40, prompt_len: int = 7, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    loss_mask[-1, seq_len - 9 :] = False  # a padded tail on the last sequence
    aux = torch.randn(batch, seq_len, cfg.num_context_features, generator=gen)
    final = torch.randn(batch, seq_len, cfg.target_hidden_size, generator=gen)
    return input_ids, loss_mask, aux, final
