"""The exported tensors, name by name and shape by shape, against tables written out here by hand.

The exporter checks its state dict against its own key table (``tensor_table``); a name or a
shape wrong in both the model and that table would pass it and every round trip through
draftforge's own loader, and SGLang, which skips unknown keys, would serve a draft with
uninitialised weights. The tables below come from contract section 4 and SGLang's loaders
(``models/dflash.py``: ``layers.{i}`` Qwen3 decoder layers loaded from unfused
``q/k/v_proj`` and ``gate/up_proj``, ``fc`` [H, K*H], ``hidden_norm``, ``norm``;
``models/dspark.py``: ``markov_head.markov_w1`` an Embedding(V, r), ``markov_w2`` a
Linear(r, V), ``gate_proj`` Linear(H + r, r) for the gated head, ``joint_proj``
Linear(2r + H, 3r) for the rnn head, ``confidence_head.proj`` Linear(H [+ r], 1); it skips
``embed_tokens.`` and ``lm_head.``). The safetensors file is read with ``safetensors`` itself.
"""

from __future__ import annotations

import json

import pytest
from dspark_helpers import tiny_draft
from safetensors import safe_open

from draftforge.train.export import export_draft


def _layers(count, *, hidden, q_dim, kv_dim, head_dim, ffn):
    """The tensors of ``count`` decoder layers (Linear weights are [out, in])."""
    table = {}
    for i in range(count):
        table.update({
            f"layers.{i}.input_layernorm.weight": (hidden,),
            f"layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"layers.{i}.self_attn.q_proj.weight": (q_dim, hidden),
            f"layers.{i}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"layers.{i}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"layers.{i}.self_attn.o_proj.weight": (hidden, q_dim),
            f"layers.{i}.self_attn.q_norm.weight": (head_dim,),
            f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
            f"layers.{i}.mlp.gate_proj.weight": (ffn, hidden),
            f"layers.{i}.mlp.up_proj.weight": (ffn, hidden),
            f"layers.{i}.mlp.down_proj.weight": (hidden, ffn),
        })  # fmt: skip
    return table


# tiny_draft: vocab 64, hidden 32, 2 layers, 4 heads, 2 KV heads (head_dim 32 / 4 = 8),
# FFN 48, 3 target layers of width 32 (fc input 96), Markov rank 8
CASES = {
    "vanilla, confidence head with Markov": (
        {},
        False,
        {
            "fc.weight": (32, 96),
            "hidden_norm.weight": (32,),
            "norm.weight": (32,),
            **_layers(2, hidden=32, q_dim=32, kv_dim=16, head_dim=8, ffn=48),
            "markov_head.markov_w1.weight": (64, 8),
            "markov_head.markov_w2.weight": (64, 8),
            "confidence_head.proj.weight": (1, 40),
            "confidence_head.proj.bias": (1,),
        },
    ),
    # head_dim 16 set explicitly: q 4 x 16 = 64 wide, not the hidden size; one KV head; two target
    # layers (fc input 64); a confidence head on the hidden state alone; the embeddings written
    "head_dim 16, confidence head alone, with embeddings": (
        dict(head_dim=16, num_key_value_heads=1, num_hidden_layers=1, target_layer_ids=[4, 0],
             confidence_head_with_markov=False, markov_rank=12),
        True,
        {
            "fc.weight": (32, 64),
            "hidden_norm.weight": (32,),
            "norm.weight": (32,),
            **_layers(1, hidden=32, q_dim=64, kv_dim=16, head_dim=16, ffn=48),
            "markov_head.markov_w1.weight": (64, 12),
            "markov_head.markov_w2.weight": (64, 12),
            "confidence_head.proj.weight": (1, 32),
            "confidence_head.proj.bias": (1,),
            "embed_tokens.weight": (64, 32),
            "lm_head.weight": (64, 32),
        },
    ),
    "gated Markov head, no confidence head": (
        dict(markov_head_type="gated", enable_confidence_head=False, confidence_head_with_markov=False),
        False,
        {
            "fc.weight": (32, 96),
            "hidden_norm.weight": (32,),
            "norm.weight": (32,),
            **_layers(2, hidden=32, q_dim=32, kv_dim=16, head_dim=8, ffn=48),
            "markov_head.markov_w1.weight": (64, 8),
            "markov_head.markov_w2.weight": (64, 8),
            "markov_head.gate_proj.weight": (8, 40),
            "markov_head.gate_proj.bias": (8,),
        },
    ),
    "rnn Markov head": (
        dict(markov_head_type="rnn"),
        False,
        {
            "fc.weight": (32, 96),
            "hidden_norm.weight": (32,),
            "norm.weight": (32,),
            **_layers(2, hidden=32, q_dim=32, kv_dim=16, head_dim=8, ffn=48),
            "markov_head.markov_w1.weight": (64, 8),
            "markov_head.markov_w2.weight": (64, 8),
            "markov_head.joint_proj.weight": (24, 48),
            "markov_head.joint_proj.bias": (24,),
            "confidence_head.proj.weight": (1, 40),
            "confidence_head.proj.bias": (1,),
        },
    ),
}


def _shapes_sglang_builds(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang's DSpark model builds from an exported config.json: the shapes
    every tensor of the checkpoint must have to load (the embeddings are not among them)."""
    hidden, rank, vocab = config["hidden_size"], config["markov_rank"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {
        "fc.weight": (hidden, len(config["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        **_layers(config["num_hidden_layers"], hidden=hidden, q_dim=heads * head_dim,
                  kv_dim=kv_heads * head_dim, head_dim=head_dim, ffn=config["intermediate_size"]),
        "markov_head.markov_w1.weight": (vocab, rank),
        "markov_head.markov_w2.weight": (vocab, rank),
    }  # fmt: skip
    if config["markov_head_type"] == "gated":
        shapes["markov_head.gate_proj.weight"] = (rank, hidden + rank)
        shapes["markov_head.gate_proj.bias"] = (rank,)
    elif config["markov_head_type"] == "rnn":
        shapes["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
        shapes["markov_head.joint_proj.bias"] = (3 * rank,)
    if config["enable_confidence_head"]:
        width = hidden + (rank if config["confidence_head_with_markov"] else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


@pytest.mark.parametrize("case", list(CASES))
def test_export_holds_exactly_the_tensors_sglang_loads(tmp_path, case):
    overrides, with_embeddings, expected = CASES[case]
    model = tiny_draft(**overrides)
    out = export_draft(model, tmp_path / "export", with_embeddings=with_embeddings, progress=lambda _: None)
    assert not list(out.glob("*.index.json"))  # one file at this size
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        written = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    missing = sorted(set(expected) - set(written))
    extra = sorted(set(written) - set(expected))
    assert not missing and not extra, f"missing {missing}; unexpected {extra}"
    wrong = {name: (written[name], shape) for name, shape in expected.items() if written[name] != shape}
    assert not wrong, f"(written, expected) shapes: {wrong}"
    # and SGLang, building its modules from config.json, expects those same shapes
    config = json.loads((out / "config.json").read_text())
    loaded = {name: shape for name, shape in expected.items() if not name.startswith(("embed_tokens.", "lm_head."))}
    assert _shapes_sglang_builds(config) == loaded
