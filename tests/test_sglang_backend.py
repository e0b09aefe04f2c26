"""The SGLang target backend: output parsing, layer order, padding and settings on CPU; parity on a GPU.

The CPU tests feed the pure functions tensors shaped exactly as SGLang 0.5.23
hands them over, built here from transformers' own ``output_hidden_states``:

* aux states: ``LogitsProcessorOutput.hidden_states``, ``[T, K*H]``, the batch's
  tokens concatenated request after request (``ScheduleBatch`` extend order),
  layers in ascending order because ``LlamaModel.forward``
  (``sglang/srt/models/llama.py``) captures inside its layer loop when
  ``i in layers_to_capture``, with ``layers_to_capture = [id + 1 ...]``
  (``set_eagle3_layers_to_capture``), recording the residual stream on entry
  to layer ``id + 1``, i.e. transformers' ``hidden_states[id + 1]``;
* final states: ``LogitsProcessorOutput.last_hidden_states``, ``[T, H]``, post-norm
  (``LogitsProcessor._get_last_hidden_states_to_store`` in
  ``sglang/srt/layers/logits_processor.py``);
* generation outputs with ``skip_tokenizer_init``: ``{"output_ids": [...],
  "meta_info": {"finish_reason": {"type": "stop" | "length", ...}}}``
  (``TokenizerManager._handle_batch_output`` and ``FINISH_*.to_json`` in
  ``sglang/srt/managers/schedule_batch.py``).

The ``gpu`` tests run the real SGLang against ``HFTarget`` on SmolLM2.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from test_target_capture import SHAPE, tiny_tokenizer

from draftforge.errors import InputError
from draftforge.splitserve import sglang_backend
from draftforge.splitserve.config import GenerationConfig, TargetConfig
from draftforge.splitserve.hf_backend import HFTarget
from draftforge.splitserve.random_target import random_llama
from draftforge.splitserve.sglang_backend import (
    FEATURE_RUNNER_SHARE,
    INSTALL_COMMAND,
    SGLANG_VERSION,
    GpuMemory,
    SGLangTarget,
    aux_in_requested_order,
    captured_order,
    engine_args,
    features_from_packed,
    gpu_shares,
    mem_fraction_static,
    pad_packed,
    reply_ids,
    require_sglang,
    rows_from_batch,
    runner_args,
    sampling_params,
)
from draftforge.splitserve.target import TargetEngine, build_target, sglang_layer_ids

LAYERS = [3, 0, 2]  # unsorted: SGLang returns them ascending, draftforge wants this order
H = SHAPE.hidden_size
SGLANG_MISSING = importlib.util.find_spec("sglang") is None


@pytest.fixture(scope="module")
def model():
    return random_llama(SHAPE, seed=5).eval()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sglang-target")
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return path


def right_padded(lengths, seq_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, SHAPE.vocab_size, (n,), generator=gen)
        mask[row, :n] = 1
    return ids, mask


def sglang_style_outputs(model, rows, layer_ids):
    """What SGLang's logits output holds after one prefill of ``rows``, from transformers' states."""
    aux, final = [], []
    with torch.no_grad():
        for row in rows:
            states = model(row.unsqueeze(0), output_hidden_states=True).hidden_states
            # "before layer i + 1" for each captured id, in the layer loop's (ascending) order
            aux.append(torch.cat([states[i + 1][0] for i in sorted(layer_ids)], dim=-1))
            final.append(states[-1][0])  # transformers' last entry is the post-norm state
    return torch.cat(aux), torch.cat(final)


# ---------------------------------------------------------------- translation and order


def test_translation_is_identity_and_capture_order_ascending():
    assert sglang_layer_ids(LAYERS) == LAYERS
    assert captured_order(LAYERS) == [0, 2, 3]


def test_aux_reordered_into_requested_order():
    # three layers whose slots hold constant 0, 2, 3 (their layer id) in SGLang's ascending order
    packed = torch.cat([torch.full((5, H), float(i)) for i in [0, 2, 3]], dim=-1)
    out = aux_in_requested_order(packed, LAYERS, H)
    for slot, layer_id in enumerate(LAYERS):
        assert torch.all(out[:, slot * H : (slot + 1) * H] == layer_id)
    already_sorted = aux_in_requested_order(packed, [0, 2, 3], H)
    assert torch.equal(already_sorted, packed)


def test_aux_width_mismatch_refused():
    with pytest.raises(ValueError, match="expected 3 layers x 64"):
        aux_in_requested_order(torch.zeros(4, 2 * H), LAYERS, H)


# ---------------------------------------------------------------- padding and rows


def test_pad_packed_places_tokens_and_zeros():
    lengths = [3, 1, 2]
    packed = torch.arange(1, 7, dtype=torch.float32).unsqueeze(1).repeat(1, 2)  # rows 1..6
    out = pad_packed(packed, lengths, seq_len=4)
    expected = (
        torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 0, 0]], dtype=torch.float32)
        .unsqueeze(-1)
        .repeat(1, 1, 2)
    )
    assert torch.equal(out, expected)


def test_pad_packed_refuses_wrong_token_count():
    with pytest.raises(ValueError, match=r"expected \[6, D\]"):
        pad_packed(torch.zeros(5, 2), [3, 1, 2], seq_len=4)


def test_rows_from_batch_unpads_and_checks_right_padding():
    ids, mask = right_padded([4, 2, 0], 5)
    rows, lengths = rows_from_batch(ids, mask)
    assert lengths == [4, 2, 0]
    assert [r.tolist() for r in rows] == [ids[0, :4].tolist(), ids[1, :2].tolist(), []]
    assert all(r.dtype == torch.int64 for r in rows)
    left = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="not right-padded"):
        rows_from_batch(torch.zeros(1, 3, dtype=torch.long), left)
    with pytest.raises(ValueError, match="differs from input_ids"):
        rows_from_batch(ids, mask[:, :3])
    assert rows_from_batch(ids, None)[1] == [5, 5, 5]


def test_features_from_sglang_packing_equal_hf_features(model):
    """SGLang-shaped outputs parse into exactly what HFTarget computes on the padded batch."""
    lengths = [7, 3, 5]
    ids, mask = right_padded(lengths, 8, seed=1)
    rows, _ = rows_from_batch(ids, mask)
    aux, final = sglang_style_outputs(model, rows, LAYERS)
    assert aux.shape == (sum(lengths), len(LAYERS) * H) and final.shape == (sum(lengths), H)
    parsed = features_from_packed(aux, final, lengths, 8, LAYERS, H, torch.float32)
    reference = HFTarget(model, None, LAYERS, name="tiny").features(ids, mask)
    torch.testing.assert_close(parsed.aux, reference.aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parsed.final, reference.final, rtol=1e-5, atol=1e-5)
    assert parsed.aux[1, 3:].abs().sum() == 0 and parsed.final[1, 3:].abs().sum() == 0


def test_features_cast_to_recipe_dtype():
    # values bf16 cannot hold exactly: each must be rounded once, where its row puts it
    gen = torch.Generator().manual_seed(4)
    aux, final = torch.randn(3, 2 * H, generator=gen), torch.randn(3, H, generator=gen)
    out = features_from_packed(aux, final, [2, 1], 2, [0, 1], H, torch.bfloat16)
    assert out.aux.dtype == torch.bfloat16 and out.final.dtype == torch.bfloat16
    assert out.aux.shape == (2, 2, 2 * H) and out.final.shape == (2, 2, H)
    for got, packed in ((out.aux, aux), (out.final, final)):
        # by hand: sequence 0 holds packed tokens 0 and 1, sequence 1 token 2 and a zero pad
        want = torch.stack([packed[0:2], torch.stack([packed[2], torch.zeros_like(packed[2])])])
        assert torch.equal(got, want.to(torch.bfloat16))
        assert not torch.equal(got.float(), want)  # the cast did round


# ---------------------------------------------------------------- generation settings and outputs


def test_sampling_params_greedy_and_sampled():
    greedy = sampling_params(GenerationConfig(temperature=0.0, max_new_tokens=9), [2, 7])
    assert greedy == {
        "max_new_tokens": 9,
        "stop_token_ids": [2, 7],
        "skip_special_tokens": True,
        "temperature": 0.0,
        "top_k": 1,
    }
    sampled = sampling_params(GenerationConfig(temperature=0.7, top_p=0.8, top_k=0), [2])
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"]) == (0.7, 0.8, -1)
    assert sampling_params(GenerationConfig(seed=1234), [2])["sampling_seed"] == 1234
    assert sampling_params(GenerationConfig(top_k=20), [2])["top_k"] == 20


def test_reply_ids_from_engine_outputs():
    stop = {"output_ids": [5, 6, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert reply_ids(stop, [2]) == ([5, 6, 2], True)
    length = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    assert reply_ids(length, [2]) == ([5, 6], False)
    trailing = {"output_ids": [5, 2, 9], "meta_info": {"finish_reason": {"type": "stop"}}}
    assert reply_ids(trailing, [2]) == ([5, 2], True)
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}
    with pytest.raises(RuntimeError, match="did not finish"):
        reply_ids(aborted, [2])


def test_the_capture_convention_is_the_one_the_model_class_implements():
    """SGLang 0.5.23's hooks: BailingMoeV3 (Ling-3.0-flash) has only the DSpark one, Qwen2
    only EAGLE3's, Llama and Qwen3 both (DFlash's under DSPARK); either gives the same state."""
    from draftforge.splitserve.sglang_backend import capture_convention

    class BailingMoeV3ForCausalLM:
        def set_dspark_layers_to_capture(self, ids): ...

    class LlamaForCausalLM:
        def set_eagle3_layers_to_capture(self, ids=None): ...
        def set_dflash_layers_to_capture(self, ids): ...

    class Qwen2ForCausalLM:
        def set_eagle3_layers_to_capture(self, ids=None): ...

    class Bare:
        pass

    assert capture_convention(BailingMoeV3ForCausalLM) == "DSPARK"
    assert capture_convention(LlamaForCausalLM) == "DSPARK"
    assert capture_convention(Qwen2ForCausalLM) == "EAGLE3"
    with pytest.raises(RuntimeError, match="SGLang's Bare implements none of set_dspark_layers_to_capture"):
        capture_convention(Bare)

    class MuseGlimmerForCausalLM:  # its DFlash hook captures entering layer i: one layer early
        def set_dflash_layers_to_capture(self, ids): ...

    with pytest.raises(RuntimeError, match="captures the state entering layer i, not leaving it"):
        capture_convention(MuseGlimmerForCausalLM)


def test_classes_that_capture_another_state_are_refused_with_their_subclasses():
    """SGLang 0.5.23's Gemma3 captures the tensor entering layer i + 1 without the residual
    stream (its layers keep the residual apart), and DeepSeek-V4's DSpark hook the attention
    input of layer i averaged over its streams: neither is transformers' hidden_states[i + 1],
    though both implement a hook draftforge would otherwise pick."""
    from draftforge.splitserve.sglang_backend import capture_convention

    class Gemma3ForCausalLM:
        def set_eagle3_layers_to_capture(self, ids=None): ...

    class Gemma3ForConditionalGeneration:
        def set_eagle3_layers_to_capture(self, ids=None): ...

    class EmbeddingGemmaModel(Gemma3ForCausalLM):  # a subclass, refused with its base
        pass

    class DeepseekV4ForCausalLM:
        def set_dspark_layers_to_capture(self, ids): ...

    class DeepseekV4ForCausalLMNextN(DeepseekV4ForCausalLM):
        pass

    for cls in (Gemma3ForCausalLM, Gemma3ForConditionalGeneration, EmbeddingGemmaModel):
        with pytest.raises(RuntimeError, match=rf"SGLang's {cls.__name__} captures, for id i, the "
                           r"tensor that enters layer i \+ 1 apart from the residual stream.*"
                           "use target.backend: hf"):
            capture_convention(cls)
    for cls in (DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN):
        with pytest.raises(RuntimeError, match=rf"SGLang's {cls.__name__} captures the attention "
                           r"input of layer i .*hyper-connection streams; use target.backend: hf"):
            capture_convention(cls)


def test_close_stops_the_runner_before_the_engine_kills_its_children():
    """SGLang's Engine.shutdown SIGKILLs every child of the process, the feature runner's
    too: the runner is stopped first, and the engine is shut down even if that fails."""
    from draftforge.splitserve.sglang_backend import SGLangTarget

    calls = []

    class Part:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def close(self):
            calls.append(self.name)
            if self.fail:
                raise RuntimeError("runner would not stop")

        shutdown = close

    target = SGLangTarget.__new__(SGLangTarget)
    target._runner, target._engine = Part("runner"), Part("engine")
    target.close()
    assert calls == ["runner", "engine"] and target._runner is None and target._engine is None
    calls.clear()
    target._runner, target._engine = Part("runner", fail=True), Part("engine")
    with pytest.raises(RuntimeError, match="would not stop"):
        target.close()
    assert calls == ["runner", "engine"] and target._runner is None and target._engine is None


def test_server_args_from_config():
    cfg = TargetConfig(model="/m", dtype="float32", generation=GenerationConfig(seed=4))
    args = runner_args(cfg, "/m", LAYERS, device=torch.device("cuda", 3), max_total_tokens=4096,
                       convention="DSPARK", memory=GpuMemory(free=80 * GIB, total=80 * GIB))
    assert args["return_aux_hidden_state_layer_ids"] == [0, 2, 3]  # ascending; we reorder back
    assert args["enable_return_aux_hidden_states"] is True
    assert args["speculative_algorithm"] == "DSPARK"
    assert (args["base_gpu_id"], args["device"], args["dtype"]) == (3, "cuda", "float32")
    assert args["trust_remote_code"] is False and args["max_total_tokens"] == 4096
    gen = engine_args(cfg, "/m", device=torch.device("cpu"))
    assert gen["skip_tokenizer_init"] is True and gen["random_seed"] == 4
    assert "base_gpu_id" not in gen and "enable_return_aux_hidden_states" not in gen


# ---------------------------------------------------------------- one GPU, two SGLang instances

GIB = 1 << 30


class SimulatedGpu:
    """One GPU as SGLang 0.5.23 fills it: an instance started with ``mem_fraction_static`` f
    measures the memory free after its CUDA context (``pre_model_load_memory``,
    ``distributed/bootstrap.py``), then sizes its KV pool so that it leaves
    ``pre * (1 - f)`` free (``KVCacheConfigurator._profile_available_bytes``,
    ``mem_cache/kv_cache_configurator.py``): weights + KV pool = f * pre. It fails as SGLang
    does when the weights do not fit (CUDA OOM) or fill f * pre (its "Loaded weights leave
    no GPU memory for the KV cache"). Each instance then uses ``runtime`` bytes of its own
    headroom (activations, CUDA graphs)."""

    CONTEXT = GIB // 2

    def __init__(self, total, weights, runtime=2 * GIB):
        self.total, self.weights, self.runtime, self.used = total, weights, runtime, 0
        self.static = {}

    def mem_get_info(self, device=None):
        return self.total - self.used, self.total

    def start(self, name, fraction, pre=None):
        """``pre``: the memory SGLang sizes from, when not this GPU's own free memory."""
        self.used += self.CONTEXT
        pre = self.total - self.used if pre is None else pre
        if self.weights > pre:
            raise MemoryError(f"{name}: CUDA out of memory loading the weights")
        static = fraction * pre
        if static <= self.weights:
            raise MemoryError(f"{name}: loaded weights leave no GPU memory for the KV cache")
        self.static[name] = static
        self.used += static + self.runtime


SGLANG_DEFAULT_ON_80GB = 0.874  # memory_hook.handle_gpu_memory_settings: (80 GiB - ~10 GiB) / 80 GiB


def test_two_instances_with_sglang_default_fraction_do_not_fit():
    """Why the split exists: with SGLang's default, the first instance leaves the second only
    its own headroom, too little for a second copy of an 8B target's weights."""
    gpu = SimulatedGpu(total=80 * GIB, weights=16 * GIB)
    gpu.start("engine", SGLANG_DEFAULT_ON_80GB)
    with pytest.raises(MemoryError, match="out of memory"):
        gpu.start("runner", SGLANG_DEFAULT_ON_80GB)


def test_gpu_shares_split_the_recipe_fraction():
    shares = gpu_shares(0.8)
    assert shares["runner"] == pytest.approx(0.8 * FEATURE_RUNNER_SHARE)
    assert shares["engine"] + shares["runner"] == pytest.approx(0.8)
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="sglang_mem_fraction must be in"):
            gpu_shares(bad)


def test_sglang_mem_fraction_is_validated_by_the_recipe():
    assert TargetConfig().sglang_mem_fraction == 0.8
    assert TargetConfig(sglang_mem_fraction=0.6).sglang_mem_fraction == 0.6
    for bad in (0.0, 1.0, 1.2):
        with pytest.raises(ValueError, match="sglang_mem_fraction"):
            TargetConfig(sglang_mem_fraction=bad)


def test_mem_fraction_static_is_the_share_of_the_total_over_what_is_free():
    whole = GpuMemory(free=80 * GIB, total=80 * GIB)
    assert mem_fraction_static(0.4, whole, who="generation engine") == 0.4
    half_free = GpuMemory(free=40 * GIB, total=80 * GIB)
    assert mem_fraction_static(0.3, half_free, who="feature runner") == 0.6
    odd = mem_fraction_static(0.4, GpuMemory(free=70 * GIB, total=80 * GIB), who="x")
    assert odd <= 0.4 * 80 / 70 and odd == pytest.approx(0.4 * 80 / 70, abs=1e-4)  # rounded down


def test_mem_fraction_static_refuses_shares_that_cannot_be_held():
    with pytest.raises(RuntimeError, match=r"feature runner is to hold 32\.0 GiB.*only 30\.0 GiB "
                                           r"of the GPU are free.*lower target\.sglang_mem_fraction"):
        mem_fraction_static(0.4, GpuMemory(free=30 * GIB, total=80 * GIB), who="feature runner")
    with pytest.raises(RuntimeError, match=r"weights \(16\.0 GiB\) fill the SGLang generation "
                                           r"engine's share.*raise target\.sglang_mem_fraction"):
        mem_fraction_static(0.2, GpuMemory(free=80 * GIB, total=80 * GIB),
                            who="generation engine", weight_bytes=16 * GIB)
    with pytest.raises(ValueError, match="implausible GPU memory"):
        mem_fraction_static(0.4, GpuMemory(free=0, total=80 * GIB), who="x")


def test_server_args_hold_each_instance_to_its_share_on_a_gpu():
    cfg = TargetConfig(model="/m", dtype="bfloat16", sglang_mem_fraction=0.8)
    gpu, whole = torch.device("cuda", 1), GpuMemory(free=80 * GIB, total=80 * GIB)
    gen = engine_args(cfg, "/m", device=gpu, memory=whole)
    run = runner_args(cfg, "/m", LAYERS, device=gpu, max_total_tokens=4096, convention="EAGLE3",
                      memory=GpuMemory(free=48 * GIB, total=80 * GIB))
    assert gen["mem_fraction_static"] == pytest.approx(0.4)
    assert run["mem_fraction_static"] == pytest.approx(0.4 * 80 / 48, abs=1e-4)
    for build in (
        lambda: engine_args(cfg, "/m", device=gpu),
        lambda: runner_args(cfg, "/m", LAYERS, device=gpu, max_total_tokens=1, convention="EAGLE3"),
    ):
        with pytest.raises(ValueError, match="needs the GPU's free and total memory"):
            build()
    with pytest.raises(RuntimeError, match="weights"):
        engine_args(cfg, "/m", device=gpu, memory=whole, weight_bytes=40 * GIB)
    # on CPU SGLang's own default stays: no GPU to share
    assert "mem_fraction_static" not in engine_args(cfg, "/m", device=torch.device("cpu"))


@pytest.mark.parametrize("engine_first", [True, False])
@pytest.mark.parametrize(("total_gib", "weights_gib"), [(80, 16), (141, 16), (48, 16), (24, 1)])
def test_both_instances_fit_one_gpu_in_either_order(engine_first, total_gib, weights_gib):
    """Built from the free memory at each start, the two shares fit together whichever
    instance starts first, and hold together what target.sglang_mem_fraction says."""
    cfg = TargetConfig(model="/m", sglang_mem_fraction=0.8)
    gpu = SimulatedGpu(total=total_gib * GIB, weights=weights_gib * GIB)
    device = torch.device("cuda", 0)
    order = ["engine", "runner"] if engine_first else ["runner", "engine"]
    for name in order:
        memory = GpuMemory(*gpu.mem_get_info())
        if name == "engine":
            args = engine_args(cfg, "/m", device=device, memory=memory)
        else:
            args = runner_args(cfg, "/m", LAYERS, device=device, max_total_tokens=65536,
                               convention="EAGLE3", memory=memory)
        gpu.start(name, args["mem_fraction_static"])
    shares = gpu_shares(0.8)
    for name in order:  # a little less than the share: SGLang measures after its CUDA context
        assert shares[name] * gpu.total - GIB <= gpu.static[name] <= shares[name] * gpu.total
    assert sum(gpu.static.values()) <= 0.8 * gpu.total


def fake_sglang(monkeypatch, start):
    """SGLang faked for SGLangTarget: its engine and the feature runner call
    ``start(name, server_args)`` as they start, and the target is a Qwen2 (EAGLE3 capture)."""
    import sys
    import types

    from draftforge.splitserve import sglang_runner

    class FakeEngine:
        def __init__(self, **kwargs):
            start("engine", kwargs)

    class FakeRunnerProcess:
        def __init__(self, server_args, *, num_threads=1):
            start("runner", server_args)

    class Qwen2ForCausalLM:
        def set_eagle3_layers_to_capture(self, ids=None): ...

    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    monkeypatch.setattr(sglang_runner, "FeatureRunnerProcess", FakeRunnerProcess)
    monkeypatch.setattr(sglang_backend, "sglang_model_class", lambda path: Qwen2ForCausalLM)


def test_sglang_target_sizes_each_instance_from_memory_free_at_its_start(
    monkeypatch, folder, model
):
    """The wiring: engine and feature runner, started lazily on a (simulated) GPU, each get
    SGLang arguments computed from the memory free when that one starts."""


    gpu = SimulatedGpu(total=80 * GIB, weights=sglang_backend.checkpoint_bytes(folder))
    started = {}

    def start(name, args):
        started[name] = args
        gpu.start(name, args["mem_fraction_static"])

    fake_sglang(monkeypatch, start)
    monkeypatch.setattr(torch.cuda, "mem_get_info", gpu.mem_get_info)
    cfg = TargetConfig(model=str(folder), dtype="bfloat16", sglang_mem_fraction=0.8)
    target = SGLangTarget(folder, LAYERS, cfg, device="cuda:0")
    target._generation_engine()
    target._feature_runner()
    engine, runner = started["engine"], started["runner"]
    assert engine["mem_fraction_static"] == pytest.approx(0.4, abs=1e-4)  # the whole GPU was free
    assert runner["mem_fraction_static"] > engine["mem_fraction_static"]  # of what was left
    assert runner["speculative_algorithm"] == "EAGLE3" and runner["base_gpu_id"] == 0
    assert sum(gpu.static.values()) <= 0.8 * gpu.total
    assert gpu.static["runner"] == pytest.approx(0.4 * gpu.total, rel=0.02)



def test_tensor_parallel_target_spans_consecutive_gpus_within_each_share(monkeypatch, folder):
    """A group of 2 led from cuda:2: both instances get tp_size 2 and base_gpu_id 2 (SGLang
    places rank i on GPU 2 + i), their fractions come from the tighter GPU (cuda:3, where
    something else holds 6 GiB), each GPU holds half the weights, and every GPU keeps within
    target.sglang_mem_fraction."""


    half = sglang_backend.checkpoint_bytes(folder) // 2
    gpus = {2: SimulatedGpu(total=80 * GIB, weights=half),
            3: SimulatedGpu(total=80 * GIB, weights=half)}
    gpus[3].used = 6 * GIB
    started, seen_store = {}, {}
    # as in a torchrun rank: SGLang's ranks must not inherit it, or they all wait as clients
    # of a rendezvous store nobody hosts (SGLang 0.5.23 under draftforge train hung so)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    def start_on_group(name, args):
        """SGLang sizes every rank of a group from the group's least free memory
        (``measure_pre_model_load_memory``: ``get_available_gpu_memory(distributed=True)``)."""
        started[name] = args
        seen_store[name] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
        group = [gpus[i] for i in range(args["base_gpu_id"], args["base_gpu_id"] + args["tp_size"])]
        pre = min(gpu.total - gpu.used - gpu.CONTEXT for gpu in group)
        for gpu in group:
            gpu.start(name, args["mem_fraction_static"], pre=pre)

    fake_sglang(monkeypatch, start_on_group)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: gpus[device.index].mem_get_info())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = TargetConfig(model=str(folder), backend="sglang", dtype="bfloat16",
                       sglang_mem_fraction=0.8)
    target = build_target(cfg, LAYERS, device="cuda:2", tensor_parallel=2)
    assert target.gpus == [2, 3]
    target._generation_engine()
    target._feature_runner()
    for name in ("engine", "runner"):
        assert started[name]["tp_size"] == 2 and started[name]["base_gpu_id"] == 2
    assert seen_store == {"engine": None, "runner": None}
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # restored for this rank
    # the engine's fraction is of the free memory on cuda:3: 32 GiB of 80 - 6 free
    assert started["engine"]["mem_fraction_static"] == pytest.approx(32 / 74, abs=1e-4)
    for gpu in gpus.values():
        assert sum(gpu.static.values()) <= 0.8 * gpu.total
    assert gpus[3].static["runner"] == pytest.approx(0.4 * gpus[3].total, rel=0.02)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ValueError, match=r"group of 2 from GPU 2 needs GPUs \[2, 3\], but 3 are visible"):
        build_target(cfg, LAYERS, device="cuda:2", tensor_parallel=2)


def test_tensor_parallel_needs_the_sglang_backend(folder):
    with pytest.raises(ValueError, match="target_tensor_parallel: 2 needs target.backend: sglang"):
        build_target(TargetConfig(model=str(folder)), [0], tensor_parallel=2)


# ---------------------------------------------------------------- install and version checks


@pytest.mark.skipif(not SGLANG_MISSING, reason="sglang is installed")
def test_missing_sglang_names_the_install_command():
    assert INSTALL_COMMAND == "pip install 'draftforge[sglang]'"
    with pytest.raises(InputError, match=r"pip install 'draftforge\[sglang\]'"):
        require_sglang()
    with pytest.raises(InputError, match=r"pip install 'draftforge\[sglang\]'"):
        build_target(TargetConfig(model="smollm2-135m-instruct", backend="sglang"), [0])


def test_wrong_sglang_version_refused(monkeypatch):
    monkeypatch.setattr(sglang_backend.importlib.metadata, "version", lambda name: "0.5.14")
    with pytest.raises(InputError, match=rf"pinned to sglang=={SGLANG_VERSION}.*0\.5\.14"):
        require_sglang()
    monkeypatch.setattr(sglang_backend.importlib.metadata, "version", lambda name: SGLANG_VERSION)
    assert require_sglang() == SGLANG_VERSION


def test_random_target_refused_for_sglang(monkeypatch):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    cfg = TargetConfig(model="random", backend="sglang", shape=SHAPE)
    with pytest.raises(ValueError, match="backend: hf"):
        build_target(cfg, [0])


# ---------------------------------------------------------------- SGLangTarget with SGLang faked


class FakeRunner:
    """Stands in for the feature runner: answers with SGLang-shaped tensors from transformers."""

    def __init__(self, model, layer_ids):
        self.model, self.layer_ids, self.calls = model, layer_ids, []

    def features(self, rows):
        self.calls.append([r.tolist() for r in rows])
        return sglang_style_outputs(self.model, rows, self.layer_ids)


@pytest.fixture
def fake_target(monkeypatch, folder, model):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    target = SGLangTarget(folder, LAYERS, TargetConfig(model=str(folder), dtype="float32"))
    target._runner = FakeRunner(model, LAYERS)
    return target


def test_sglang_target_protocol_and_weights(fake_target, model):
    assert isinstance(fake_target, TargetEngine)
    assert (fake_target.num_hidden_layers, fake_target.hidden_size) == (5, 64)
    assert torch.equal(fake_target.embed_tokens_weight(), model.model.embed_tokens.weight)
    assert torch.equal(fake_target.lm_head_weight(), model.lm_head.weight)


def _bailing_style_folder(folder, tmp_path, *, tied=False):
    """The tiny target's files with its embedding named as Bailing/Ling name it
    (model.word_embeddings.weight), in two shards and an index; ``tied``: no lm_head."""
    import shutil

    from safetensors.torch import load_file, save_file

    ling = tmp_path / "ling"
    shutil.copytree(folder, ling, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    state = {}
    for file in folder.glob("*.safetensors"):
        state.update(load_file(str(file)))
    state["model.word_embeddings.weight"] = state.pop("model.embed_tokens.weight")
    if tied:
        del state["lm_head.weight"]
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, shard in shards.items():
        save_file({name: state[name].contiguous() for name in shard}, str(ling / file))
    weight_map = {name: file for file, shard in shards.items() for name in shard}
    (ling / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ling


def test_sglang_target_reads_a_bailing_checkpoints_word_embeddings(monkeypatch, folder, model, tmp_path):
    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: SGLANG_VERSION)
    ling = _bailing_style_folder(folder, tmp_path)
    target = SGLangTarget(ling, LAYERS, TargetConfig(model=str(ling), dtype="float32"))
    assert torch.equal(target.embed_tokens_weight(), model.model.embed_tokens.weight)
    assert torch.equal(target.lm_head_weight(), model.lm_head.weight)
    # a tied target without lm_head.weight: its output head is the embedding
    target.folder = _bailing_style_folder(folder, tmp_path / "tied", tied=True)
    target.tie_word_embeddings = True
    assert torch.equal(target.lm_head_weight(), model.model.embed_tokens.weight)


def test_a_target_without_an_embedding_is_an_input_error_naming_the_folder(tmp_path):
    from safetensors.torch import save_file

    from draftforge.errors import InputError

    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError) as err:
        sglang_backend.read_weight(tmp_path, sglang_backend.EMBEDDING_NAMES, what="input embedding")
    assert str(err.value) == (f"target folder {tmp_path}: no input embedding tensor; looked for "
                              "model.embed_tokens.weight, model.word_embeddings.weight in its *.safetensors files")


def test_sglang_target_features_skip_empty_rows(fake_target, model):
    ids, mask = right_padded([4, 0, 2], 6, seed=3)
    features = fake_target.features(ids, mask)
    assert fake_target._runner.calls == [[ids[0, :4].tolist(), ids[2, :2].tolist()]]
    reference = HFTarget(model, None, LAYERS, name="tiny").features(ids, mask)
    for row in (0, 2):
        torch.testing.assert_close(features.aux[row], reference.aux[row], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(features.final[row], reference.final[row], rtol=1e-5, atol=1e-5)
    assert features.aux[1].abs().sum() == 0 and features.final[1].abs().sum() == 0


def test_sglang_target_generate_renders_and_decodes(fake_target):
    seen = {}
    tokenizer = fake_target.tokenizer
    w5, eos = tokenizer.convert_tokens_to_ids("w5"), tokenizer.eos_token_id

    class FakeEngine:
        def generate(self, input_ids, sampling_params):
            seen.update(input_ids=input_ids, params=sampling_params)
            return [
                {"output_ids": [w5, eos], "meta_info": {"finish_reason": {"type": "stop"}}},
                {"output_ids": [w5, w5], "meta_info": {"finish_reason": {"type": "length"}}},
            ]

    fake_target._engine = FakeEngine()
    conversations = [[{"role": "user", "content": "w1 w2"}], [{"role": "user", "content": "w3"}]]
    replies = fake_target.generate(
        conversations, GenerationConfig(temperature=0.0, max_new_tokens=2)
    )
    expected_prompt = tokenizer.apply_chat_template(
        conversations[0], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert seen["input_ids"][0] == list(expected_prompt)
    assert seen["params"]["stop_token_ids"] == [eos] and seen["params"]["top_k"] == 1
    assert [str(r) for r in replies] == ["w5", "w5 w5"]
    assert [r.finished for r in replies] == [True, False]
    assert [r.token_ids for r in replies] == [(w5,), (w5, w5)]  # the end-of-turn token left out


# ---------------------------------------------------------------- the real SGLang
#
# On a GPU: ``pytest -m gpu``. On the CPU, opt-in with DRAFTFORGE_SGLANG_CPU=1 in a venv
# where SGLang 0.5.23 runs there (a minute or two per case). Measured on a 2-core AMD EPYC
# (2026-12-02): tensor parallel 1 and 2 both pass. The venv: the one in
# tests/test_sglang_loader.py's docstring, plus ``pip install --no-deps uvicorn fastapi
# uvloop`` (the runner's imports need them), ``pip install tqdm accelerate`` (draftforge's),
# and tests/sglang_shims.py installed in every process, the spawned ones too, by a
# ``sitecustomize.py`` in the venv's site-packages::
#
#     import sys; sys.path.insert(0, "/path/to/draftforge/tests")
#     import sglang_shims; sglang_shims.install()


def gpu_sglang(test):
    """Marks a test that runs the real SGLang: ``gpu``, skipped without CUDA or without sglang."""
    test = pytest.mark.skipif(
        SGLANG_MISSING, reason=f"needs sglang=={SGLANG_VERSION}: {INSTALL_COMMAND}"
    )(test)
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
    return pytest.mark.gpu(test)


def cpu_sglang(test):
    """Marks a test that runs the real SGLang on the CPU: opt-in, see above."""
    test = pytest.mark.skipif(
        SGLANG_MISSING, reason=f"needs sglang=={SGLANG_VERSION}: {INSTALL_COMMAND}"
    )(test)
    return pytest.mark.skipif(
        os.environ.get("DRAFTFORGE_SGLANG_CPU") != "1",
        reason="SGLang on the CPU is opt-in: DRAFTFORGE_SGLANG_CPU=1 (see the comment above)",
    )(test)


SMOL_LAYERS = [20, 1, 14]  # unsorted on purpose; SmolLM2-135M has 30 decoder layers


def smol_targets(device, tensor_parallel=1):
    from draftforge.splitserve.smollm2 import NAME, ensure_smollm2

    folder = ensure_smollm2()
    cfg = TargetConfig(model=NAME, dtype="float32")
    hf = HFTarget.from_folder(folder, SMOL_LAYERS, cfg, name=NAME, device=device)
    # a small KV pool: on the CPU each SGLang rank allocates all of it up front
    sgl = SGLangTarget(folder, SMOL_LAYERS, cfg, name=NAME, device=device,
                       tensor_parallel=tensor_parallel, max_total_tokens=8192)
    return hf, sgl


@pytest.fixture(scope="module")
def smol_pair():
    hf, sgl = smol_targets("cuda")
    yield hf, sgl
    sgl.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def smol_pair_cpu(request):
    hf, sgl = smol_targets("cpu", tensor_parallel=request.param)
    yield hf, sgl
    sgl.close()


def check_features_match(hf, sgl):
    prompt = [{"role": "user", "content": "Name three prime numbers."}]
    text = hf.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    first = hf.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    second = first[: len(first) // 2]
    ids = torch.zeros(2, len(first), dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = first, 1
    ids[1, : len(second)], mask[1, : len(second)] = second, 1
    got, want = sgl.features(ids, mask), hf.features(ids.to(hf.device), mask.to(hf.device))
    assert got.aux.shape == want.aux.shape and got.final.shape == want.final.shape
    # different kernels (SGLang's attention vs transformers' sdpa): float32 agreement, not bitwise
    torch.testing.assert_close(got.aux, want.aux, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got.final, want.final, rtol=1e-3, atol=1e-3)
    assert got.aux[1, len(second) :].abs().sum() == 0
    again = sgl.features(ids[1:], mask[1:])  # a second call: nothing carried over
    torch.testing.assert_close(again.aux[0], got.aux[1], rtol=1e-5, atol=1e-5)


def check_greedy_generation_matches(hf, sgl):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write one sentence about the sea."}],
    ]
    settings = GenerationConfig(temperature=0.0, max_new_tokens=24)
    got, want = sgl.generate(conversations, settings), hf.generate(conversations, settings)
    assert [str(r) for r in got] == [str(r) for r in want]
    assert [r.finished for r in got] == [r.finished for r in want]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


@gpu_sglang
def test_sglang_features_match_hf_on_smollm2(smol_pair):
    check_features_match(*smol_pair)


@gpu_sglang
def test_sglang_greedy_generation_matches_hf_on_smollm2(smol_pair):
    check_greedy_generation_matches(*smol_pair)


@cpu_sglang
def test_sglang_on_cpu_features_match_hf_on_smollm2(smol_pair_cpu):
    """Tensor parallel 2: two SGLang ranks, each a child process, all-reducing over gloo."""
    check_features_match(*smol_pair_cpu)


@cpu_sglang
def test_sglang_on_cpu_greedy_generation_matches_hf_on_smollm2(smol_pair_cpu):
    check_greedy_generation_matches(*smol_pair_cpu)


def test_cpu_ranks_beyond_the_numa_nodes_get_an_explicit_thread_binding():
    """SGLang 0.5.23 refuses more CPU ranks than NUMA nodes unless SGLANG_CPU_OMP_THREADS_BIND
    names each rank's CPUs: a tensor-parallel target on a one-node CPU failed to start
    without it (run with SGLang 0.5.23 on this machine)."""
    from draftforge.splitserve.sglang_backend import cpu_threads_bind, numa_node_count

    assert cpu_threads_bind(2, cpus=[0, 1], numa_nodes=1) == "0|1"
    assert cpu_threads_bind(2, cpus={5, 4, 7, 6}, numa_nodes=1) == "4,5|6,7"
    assert cpu_threads_bind(3, cpus=[0, 1, 2, 3, 4, 5, 6], numa_nodes=1) == "0,1|2,3|4,5,6"
    assert cpu_threads_bind(4, cpus=[0, 1], numa_nodes=1) == "0|0|1|1"  # fewer CPUs than ranks
    assert cpu_threads_bind(2, cpus=[0, 1, 2, 3], numa_nodes=2) is None  # SGLang's default holds
    assert cpu_threads_bind(1, cpus=[0], numa_nodes=0) is None
    assert numa_node_count() >= 1


def test_a_features_batch_larger_than_the_runners_pool_is_refused_with_the_recipe():
    """The runner's KV pool holds 65,536 tokens: 9 rows of 8192 (the Ling recipe with one
    more row a batch) failed only when the first batch reached it, on the GPUs."""
    from pathlib import Path

    from draftforge.config import RecipeError, load_recipe
    from draftforge.splitserve.roles import check_split

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "ling3-flash-dspark.yaml"
    check_split(load_recipe(recipe), cuda_devices=8)  # 8 x 8192: exactly the pool
    with pytest.raises(RecipeError) as err:
        check_split(load_recipe(recipe, ["split.feature_batch_size=9"]), cuda_devices=8)
    assert err.value.problems == [
        "command line 'split.feature_batch_size=9': split.feature_batch_size: 9 rows of up to "
        "data.max_length 8192 tokens exceed the SGLang feature runner's KV pool of 65536 tokens; "
        "lower one of them"]
