"""Round 45 of the transformers target: decoding a model whose forward predates ``logits_to_keep``."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.hf_backend import _left_padded, _until_eos
from draftforge.splitserve.sampling import decode


class OlderForward(torch.nn.Module):
    """A causal LM whose forward has explicit arguments and neither ``logits_to_keep`` nor
    ``**kwargs``, as remote-code models written before transformers added it (DeepSeek-V2's
    ``modeling_deepseek.py``); it runs a transformers Llama underneath."""

    def __init__(self, inner: LlamaForCausalLM) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=past_key_values, use_cache=use_cache)
        return type("Out", (), {"logits": out.logits, "past_key_values": out.cache})()


def test_a_model_whose_forward_lacks_logits_to_keep_decodes_as_transformers_generates():
    """decode passed ``logits_to_keep=1`` to every model: one whose forward does not take it
    raised "forward() got an unexpected keyword argument 'logits_to_keep'". transformers'
    generate passes it only where the forward names it; so does decode now, and the greedy
    tokens are transformers' own (each prompt generated alone, unpadded)."""
    torch.manual_seed(0)
    inner = LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=64)).eval()
    prompts = [[5, 6, 7, 8], [9, 10]]
    input_ids, attention_mask = _left_padded(prompts, 0)
    settings = GenerationConfig(temperature=0.0, max_new_tokens=6)
    eos = [2]
    out = decode(OlderForward(inner), input_ids, attention_mask, settings, eos_ids=eos, pad_id=0,
                 generator=None)
    for prompt, row in zip(prompts, out.tolist(), strict=True):
        with torch.no_grad():
            expected = inner.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                      eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
        assert _until_eos(row, set(eos)) == _until_eos(expected, set(eos))
