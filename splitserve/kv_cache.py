"""A KV cache for the decoding loop that fills a buffer instead of growing by concatenation.

``transformers``' ``DynamicCache`` appends every new token's keys and values with
``torch.cat``, which copies the layer's whole cache at every step. On a CPU at batch 16
that copying was about a fifth of each decoding step of SmolLM2-135M-Instruct (float32,
one thread), growing with the length of the answer. ``GrowingCache`` gives every layer a
buffer sized for the prompt and the new tokens at the start, writes each step into it
in place and hands attention a view of the filled part. Attention reads the same keys
and values in the same order, so the logits are bit-identical to ``DynamicCache``'s
(the tests compare them); a buffer that fills up is doubled, never overrun.

Only for models whose every layer attends to the whole sequence (no sliding-window or
linear-attention layers, which keep other state): ``growing_cache`` returns None for
the others and the model keeps its own cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """One layer's keys and values [B, heads, length, head_dim] in a preallocated buffer."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, length, _ = key_states.shape
        capacity = max(self.capacity, length)
        self._buffers = tuple(
            states.new_empty(batch, heads, capacity, states.shape[-1])
            for states in (key_states, value_states))
        self._length = 0
        self.is_initialized = True

    def _expose(self) -> None:
        keys, values = self._buffers
        self.keys = keys[:, :, : self._length]
        self.values = values[:, :, : self._length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        keys, values = self._buffers
        if end > keys.shape[-2]:  # full: double it (one copy, like a single concatenation)
            capacity = max(end, 2 * keys.shape[-2])
            grown = []
            for old in (keys, values):
                new = old.new_empty(*old.shape[:2], capacity, old.shape[-1])
                new[:, :, : self._length].copy_(old[:, :, : self._length])
                grown.append(new)
            self._buffers = keys, values = tuple(grown)
        keys[:, :, self._length : end].copy_(key_states)
        values[:, :, self._length : end].copy_(value_states)
        self._length = end
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (the decoding loop drops rows that have ended): their
        filled positions are copied into buffers of the same capacity, whose unfilled part is
        never written (selecting the whole buffer wrote it all, making the pages of a long
        ``max_new_tokens`` resident: 1.3 GiB more for 8 rows of SmolLM2 at 4096)."""
        if self.is_initialized:
            kept = []
            for buffer in self._buffers:
                new = buffer.new_empty(len(indices), *buffer.shape[1:])
                new[:, :, : self._length] = buffer[:, :, : self._length].index_select(0, indices.to(buffer.device))
                kept.append(new)
            self._buffers = tuple(kept)
            self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self._length = max(0, self._length + tokens_to_remove)
            self._expose()

    def reset(self) -> None:
        self._buffers, self._length = None, 0
        super().reset()

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("GrowingLayer serves the decoding loop only: no beam search, no offloading")

    batch_repeat_interleave = reorder_cache = offload = prefetch = _unsupported


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` whose layers are ``GrowingLayer``s of ``capacity`` positions."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        Cache.__init__(self, layers=[GrowingLayer(capacity) for _ in range(num_layers)])


def growing_cache(model, capacity: int) -> GrowingCache | None:
    """A cache of ``capacity`` positions for ``model``, or None where every layer is not
    plain full attention (the model's own cache is used there)."""
    config = getattr(model, "config", None)
    if config is None:  # not a transformers model (a test's stand-in): its own cache
        return None
    config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    return GrowingCache(int(config.num_hidden_layers), capacity)
