"""What the draft's backbone keeps for backward in one micro-batch, counted tensor by tensor.

The dry run's trainer estimate needs the activations the backbone (``fc``, ``hidden_norm``
and the decoder layers, up to the final norm; the objective's vocabulary chunk is counted
apart) holds from its forward to its backward. The counts below follow the tensors
autograd saves, measured with ``torch.autograd.graph.saved_tensors_hooks`` on the CPU
(``tests/test_draft_activations.py`` measures them at several shapes and compares), for
the three ways a trainer runs the draft:

- ``float32``: train.dtype float32, everything in fp32;
- ``autocast``: train.strategy single in bf16, fp32 parameters under bf16 autocast: matmul
  inputs are cast to bf16 (once per projection that reads them) and each layer's weights
  are kept as bf16 copies, while the residual stream and the norms stay in fp32;
- ``bf16``: fsdp2 or deepspeed in bf16, the layers compute with bf16 parameters, the norms
  upcasting their inputs to fp32.

With sdpa attention the layers repeat grouped key/value heads to the query heads and pass
a dense mask, both of which attention keeps; flex attention keeps neither (its keys and
values stay grouped, its block mask is small). Widths: ``H`` hidden, ``I`` intermediate,
``Q`` heads x head_dim, ``K`` key/value heads x head_dim; ``L`` block tokens (anchors x
block size) and ``C`` context tokens (the micro-batch's rows x their padded length).
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["float32", "autocast", "bf16"]


def precision_of(strategy: str, dtype: str) -> Precision:
    """How the trainer computes the draft (see the module's docstring)."""
    if dtype == "float32":
        return "float32"
    return "autocast" if strategy == "single" else "bf16"


def backbone_saved_bytes(draft, *, target_hidden_size: int, block_tokens: int, context_tokens: int,
                         sequences: int, precision: Precision) -> int:
    """Bytes the backbone keeps for backward: ``draft`` a DraftConfig (or DSparkConfig) with
    its widths, ``sequences`` the micro-batch's rows (sdpa's mask is per row)."""
    hidden, inter = draft.hidden_size, draft.intermediate_size
    head_dim = draft.head_dim or hidden // draft.num_attention_heads
    q, kv = draft.num_attention_heads * head_dim, draft.num_key_value_heads * head_dim
    block, ctx, layers = block_tokens, context_tokens, draft.num_hidden_layers
    sdpa = draft.attention_backend == "sdpa"
    keys = q if sdpa else kv  # width of the keys and values attention keeps
    mask = block * (ctx + block) // max(1, sequences) if sdpa else 0
    attention = 2 * (ctx + block) * keys + mask  # in the compute dtype
    features = ctx * len(draft.target_layer_ids) * target_hidden_size  # fc's input
    if precision == "float32":
        # per layer: the MLP's gate, up, activation and product; the norms' inputs, scaled
        # values and outputs; the query before and after its norm, rotated, and attention's
        # output; the block's keys before and after their norm, and the context's
        per_layer = block * (4 * inter + 5 * hidden + 4 * q + 2 * kv) + 2 * ctx * kv + attention
        # fc's input and output, hidden_norm's scaled context and its output (the context's key
        # and value projections keep it), the block's embeddings, the final norm's input and
        # scaled values, and the rotary cos and sin tables of the context and the block
        outside = features + 3 * ctx * hidden + 3 * block * hidden + 2 * (ctx + block) * head_dim
        return 4 * (layers * per_layer + outside)
    if precision == "autocast":
        wide = block * (3 * hidden + q + kv) + ctx * kv  # residual stream and norm inputs, fp32
        weights = hidden * (2 * q + 2 * kv) + 3 * hidden * inter  # each layer's bf16 copies
        narrow = (block * (4 * inter + 5 * hidden + 3 * q + kv) + ctx * (kv + 2 * hidden)
                  + attention + weights)
        outside = 2 * features + 4 * (2 * ctx * hidden + 3 * block * hidden)
        return layers * (4 * wide + 2 * narrow) + outside
    wide = block * (3 * hidden // 2 + q + kv) + ctx * kv  # the norms' fp32 upcasts
    narrow = block * (4 * inter + 7 * hidden // 2 + 3 * q + kv) + ctx * kv + attention
    outside = 2 * (features + 2 * ctx * hidden + 3 * block * hidden)
    return layers * (4 * wide + 2 * narrow) + outside
