"""SGLang 0.5.23's own DSpark draft class loads a draftforge export, tensor for tensor.

Builds ``sglang.srt.models.dspark.Qwen3DSparkModel`` (``DSparkDraftMixin`` over
``dflash.DFlashDraftModel``) on CPU from an export's ``config.json`` (read with
SGLang's ``get_config``), runs its ``load_weights`` over the export's
``model.safetensors`` (read with SGLang's ``safetensors_weights_iterator``) and
checks, with a key mapping written here independently of SGLang's:

* every export tensor lands, with exactly its values and dtype, in the
  parameter slice SGLang keeps it in (the confidence head is always float32 in
  SGLang: a bf16 export's head is upcast, exactly).  SGLang fuses ``q/k/v_proj`` into
  ``self_attn.qkv_proj`` (rows q | k | v) and ``gate/up_proj`` into
  ``mlp.gate_up_proj`` (rows gate | up); every other name is kept as is;
* those slices cover every parameter of SGLang's module (nothing left at its
  initial value), and the only buffers are the ones SGLang computes itself;
* no export tensor is skipped except the ones SGLang skips by design:
  ``embed_tokens``/``lm_head`` (the target's are attached) and, in SGLang's
  default ``SGLANG_RAGGED_VERIFY_MODE=static``, the confidence head, which is
  then not built at all (it is built only for ``cap-accept``/``compact``);
* the module reads the export's block size, context width, Markov head type
  and rank and the confidence head's input width.

SGLang is not a project dependency (its wheel pulls CUDA packages and a newer
torch), so this module skips where it is not importable, as in ``make test``.
A venv in which it runs on CPU (about 2 minutes, 2.5 GB, triton being 1 GB of it;
never torchvision, which ``sglang_shims.py`` stands in for)::

    python3 -m venv /tmp/sglvenv && P=/tmp/sglvenv/bin/pip
    $P install torch==2.13.0
    $P install --no-deps sglang==0.5.23
    $P install numpy transformers==5.24.0 safetensors pydantic pyyaml
    $P install --no-deps orjson psutil pybase64 requests urllib3 certifi triton pillow \
      starlette msgspec pyzmq ipython traitlets aiohttp multidict attrs yarl propcache \
      aiohappyeyeballs aiosignal frozenlist apache-tvm-ffi==0.1.11 dill sentencepiece \
      compressed-tensors loguru gguf einops openai sniffio partial-json-parser pytest \
      pluggy iniconfig
    $P install --no-deps -e .   # draftforge itself
    OMP_NUM_THREADS=1 /tmp/sglvenv/bin/pytest -q tests/test_sglang_loader.py

``DRAFTFORGE_SGLANG_EXPORT=DIR`` adds a check of a real export folder.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from dspark_helpers import tiny_draft

SGLANG_VERSION = "0.5.23"

# SGLang decides "CPU engine" once, at import (``is_cpu()``); without it the rotary
# embedding asks for vllm's CUDA kernel.  Only SGLang reads this variable.
if importlib.util.find_spec("sglang") is not None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

sglang = pytest.importorskip(
    "sglang", reason="sglang is not installed (optional; see module docstring)"
)
if getattr(sglang, "__version__", None) != SGLANG_VERSION:
    pytest.skip(
        f"written against sglang {SGLANG_VERSION} internals, found {getattr(sglang, '__version__', '?')}",
        allow_module_level=True,
    )

import sglang_shims  # noqa: E402

sglang_shims.install()

from draftforge.train.export import export_draft  # noqa: E402

try:
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.dspark import (
        GatedMarkovHead,
        Qwen3DSparkModel,
        RNNHead,
        VanillaMarkov,
    )
    from sglang.srt.runtime_context import reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config
    from sglang.test.parallel_groups import publish
except ImportError as exc:  # a pure-python dependency of SGLang's model code is missing
    pytest.skip(
        f"sglang {SGLANG_VERSION} model code not importable on CPU: {exc}", allow_module_level=True
    )

MARKOV_CLASSES = {"vanilla": VanillaMarkov, "gated": GatedMarkovHead, "rnn": RNNHead}
# Buffers SGLang computes itself (RoPE table; STS temperatures come from a separate JSON).
COMPUTED_BUFFERS = ("rotary_emb.cos_sin_cache", "confidence_head.sts_temperatures")


@pytest.fixture(scope="module", autouse=True)
def sglang_context():
    """The process-wide SGLang context its layers read (tp size 1, rank 0), no process group."""
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test")
    yield
    reset_context()


def build_sglang_draft(export_dir, monkeypatch, ragged_verify_mode: str):
    config = get_config(str(export_dir), trust_remote_code=False)
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", ragged_verify_mode)
    dtype = getattr(config, "dtype", None) or config.torch_dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with set_default_torch_dtype(dtype):
        model = Qwen3DSparkModel(config)
    return config, model


def sglang_slot(config, name: str) -> tuple[str, slice]:
    """Where SGLang keeps export tensor ``name``: (parameter name, rows). Written from the
    export's config, not from SGLang's attributes, so a wrong fusion would show."""
    head_dim = config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    ffn = config.intermediate_size
    fused = {
        ".self_attn.q_proj.": ("qkv_proj", slice(0, q_rows)),
        ".self_attn.k_proj.": ("qkv_proj", slice(q_rows, q_rows + kv_rows)),
        ".self_attn.v_proj.": ("qkv_proj", slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
        ".mlp.gate_proj.": ("gate_up_proj", slice(0, ffn)),
        ".mlp.up_proj.": ("gate_up_proj", slice(ffn, 2 * ffn)),
    }
    for part, (param, rows) in fused.items():
        if part in name:
            old = part.strip(".").split(".")[-1]
            return name.replace(old, param), rows
    return name, slice(None)


def load_and_check(export_dir, model, config, *, expected_skipped: set[str]):
    """Run SGLang's load_weights over the export and check every tensor and parameter."""
    files = sorted(str(p) for p in export_dir.glob("*.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for param in params.values():
            param.fill_(float("nan"))
    model.load_weights(safetensors_weights_iterator(files))

    export = dict(safetensors_weights_iterator(files))
    covered = {name: torch.zeros(p.shape[0], dtype=torch.bool) for name, p in params.items()}
    skipped = set()
    for name, tensor in export.items():
        param_name, rows = sglang_slot(config, name)
        if param_name not in params:
            skipped.add(name)
            continue
        target = params[param_name].detach()[rows]
        if name.startswith("confidence_head.") and target.dtype != tensor.dtype:
            # SGLang builds its confidence head in float32 whatever the checkpoint dtype;
            # the upcast of a bf16/fp16 tensor is exact.
            assert target.dtype == torch.float32, (name, target.dtype)
            tensor = tensor.float()
        assert target.dtype == tensor.dtype, (name, target.dtype, tensor.dtype)
        assert target.shape == tensor.shape, (name, param_name, target.shape, tensor.shape)
        assert torch.equal(target, tensor), f"{name} -> {param_name}[{rows}] differs after load"
        assert not covered[param_name][rows].any(), (
            f"two export tensors map onto {param_name}[{rows}]"
        )
        covered[param_name][rows] = True

    assert skipped == expected_skipped, (
        f"export tensors SGLang has no parameter for: {sorted(skipped)}"
    )
    uncovered = sorted(name for name, mask in covered.items() if not mask.all())
    assert not uncovered, f"SGLang parameters the export does not fill: {uncovered}"
    assert not any(torch.isnan(p).any() for p in params.values())
    buffers = [name for name, _ in model.named_buffers()]
    assert all(name.endswith(COMPUTED_BUFFERS) for name in buffers), buffers
    return export


@pytest.mark.parametrize(
    "head_type,dtype,mode",
    [
        ("vanilla", torch.float32, "cap-accept"),
        ("gated", torch.float32, "compact"),
        ("rnn", torch.float32, "cap-accept"),
        ("vanilla", torch.bfloat16, "cap-accept"),
        ("vanilla", torch.float32, "static"),
    ],
)
def test_sglang_loads_every_tensor(tmp_path, monkeypatch, head_type, dtype, mode):
    draft = tiny_draft(markov_head_type=head_type, dtype=dtype)
    out = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    config, model = build_sglang_draft(out, monkeypatch, mode)
    cfg = draft.config

    # The module reads the export's DSpark fields.
    assert model.block_size == model.gamma == cfg.block_size
    assert model.num_context_features == len(cfg.target_layer_ids)
    assert model.fc.in_features == cfg.num_context_features
    assert model.draft_config.mask_token_id == cfg.mask_token_id
    assert list(model.draft_config.target_layer_ids) == list(cfg.target_layer_ids)
    assert type(model.markov_head) is MARKOV_CLASSES[head_type]
    assert model.markov_head.markov_rank == cfg.markov_rank
    assert len(model.layers) == cfg.num_hidden_layers

    confidence_keys = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    if mode == "static":
        # SGLang's default verify mode builds no confidence head and drops its tensors.
        assert model.confidence_head is None
        expected_skipped = confidence_keys
    else:
        assert model.confidence_head.with_markov == cfg.confidence_head_with_markov
        expected_skipped = set()
    load_and_check(out, model, config, expected_skipped=expected_skipped)


def test_sglang_ignores_exported_embeddings(tmp_path, monkeypatch):
    draft = tiny_draft()
    out = export_draft(draft, tmp_path / "export", with_embeddings=True, progress=lambda _: None)
    config, model = build_sglang_draft(out, monkeypatch, "cap-accept")
    load_and_check(out, model, config, expected_skipped={"embed_tokens.weight", "lm_head.weight"})


def test_export_without_confidence_head(tmp_path, monkeypatch):
    """``enable_confidence_head: false`` exports no confidence tensors.  SGLang loads that in
    its default static mode, but in cap-accept/compact it builds the head regardless of
    the flag and refuses the checkpoint: such a draft cannot use confidence scheduling."""
    draft = tiny_draft(enable_confidence_head=False)
    out = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    config, model = build_sglang_draft(out, monkeypatch, "static")
    load_and_check(out, model, config, expected_skipped=set())

    config, model = build_sglang_draft(out, monkeypatch, "cap-accept")
    assert model.confidence_head is not None
    with pytest.raises(
        ValueError, match="confidence head is enabled but the checkpoint is missing"
    ):
        model.load_weights(safetensors_weights_iterator([str(out / "model.safetensors")]))


@pytest.mark.skipif(
    not os.environ.get("DRAFTFORGE_SGLANG_EXPORT"),
    reason="set DRAFTFORGE_SGLANG_EXPORT to an export folder to check a real one",
)
def test_sglang_loads_real_export(monkeypatch):
    from pathlib import Path

    out = Path(os.environ["DRAFTFORGE_SGLANG_EXPORT"])
    config, model = build_sglang_draft(out, monkeypatch, "cap-accept")
    load_and_check(out, model, config, expected_skipped=set())


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_sglang_heads_match_draftforge(tmp_path, monkeypatch, head_type):
    """After loading, SGLang's context projection, Markov step bias and confidence head give
    draftforge's numbers for one drafted block.  The decoder layers themselves run through
    SGLang's RadixAttention/KV pool and are not compared here."""
    draft = tiny_draft(markov_head_type=head_type).eval()
    cfg = draft.config
    out = export_draft(draft, tmp_path / "export", progress=lambda _: None)
    config, model = build_sglang_draft(out, monkeypatch, "cap-accept")
    load_and_check(out, model, config, expected_skipped=set())

    gen = torch.Generator().manual_seed(3)
    aux = torch.randn(2, 6, cfg.num_context_features, generator=gen)
    anchor = torch.tensor([3, 9])
    with torch.no_grad():
        assert torch.equal(model.project_target_hidden(aux[0]), draft.fuse_context(aux[0]))
        hidden = draft.block_forward(anchor, 6, aux)
        tokens, logits, confidence = draft.draft_block(hidden, anchor)
        # SGLang's unquantized head projection is this matmul (project_through_lm_head).
        base = torch.matmul(hidden, draft.lm_head.weight.T).float()
        prev, state, steps = anchor, model.markov_head.init_state(hidden[:, 0]), []
        for k in range(cfg.block_size):
            bias, state = model.markov_head.step_bias(prev, hidden_states=hidden[:, k], state=state)
            steps.append(base[:, k] + bias.float())
            prev = tokens[:, k]
        _, confidence_raw = model.compute_confidence(
            anchor_tokens=anchor,
            draft_tokens=tokens,
            confidence_features=hidden.reshape(-1, cfg.hidden_size),
        )
    torch.testing.assert_close(torch.stack(steps, dim=1), logits, rtol=0, atol=0)
    torch.testing.assert_close(confidence_raw, confidence, rtol=1e-6, atol=1e-6)
