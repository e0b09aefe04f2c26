"""A target spread over several devices for the evaluator (``draftforge eval --device cuda:0,cuda:1``).

On CPU the device names, the memory plan and the placement checks are tested
as functions, and the real SmolLM2 is run through accelerate's dispatch (half
its layers offloaded to disk, so every one of them runs under accelerate's
hooks): its features, its KV-cached verification and a speculative decode
must equal the whole model's. Across two GPUs the same comparison is a GPU test.
"""

from __future__ import annotations

import pytest
import torch
from eval_helpers import smollm2_draft

from draftforge.errors import InputError
from draftforge.eval.speculative import (
    DecodeSettings,
    DraftProposer,
    TargetSession,
    speculative_decode,
)
from draftforge.splitserve.placement import (
    WEIGHT_SHARE,
    Spread,
    check_placement,
    describe_placement,
    plan_device_map,
    resolve_devices,
    spread_placement,
)

GIB = 1 << 30
LAYERS = [1, 14, 27]  # SmolLM2's layers the draft reads in the tests with the real target


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_auto_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_devices("auto", [0, 1, 2, 3]) == ["cpu"]
    assert resolve_devices("cpu") == ["cpu"]
    with pytest.raises(InputError, match="no CUDA GPU is visible"):
        resolve_devices("cuda:0,cuda:1")


def test_auto_is_every_target_gpu_of_the_recipe(four_gpus):
    assert resolve_devices("auto", [0, 1, 2, 3]) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert resolve_devices("auto", [2, 3]) == ["cuda:2", "cuda:3"]
    assert resolve_devices("auto", None) == ["cuda:0"]
    assert resolve_devices("cuda") == ["cuda:0"]
    assert resolve_devices("cuda:1, cuda:3") == ["cuda:1", "cuda:3"]
    # accelerate fills by index, so the first device (the draft's) is the lowest, whatever the order
    assert resolve_devices("cuda:3,cuda:1") == ["cuda:1", "cuda:3"]


def test_accelerate_fills_gpus_in_index_order_whatever_order_they_are_given():
    """Why resolve_devices sorts: the map puts the embedding on the lowest GPU even when the
    max_memory dict names another first (the draft shares the first device with the inputs)."""
    from accelerate import infer_auto_device_map

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    device_map = infer_auto_device_map(model, max_memory={1: 40_000, 0: 40_000})
    assert device_map["0"] == 0


@pytest.mark.parametrize("choice,message", [
    ("cuda:0,cuda:0", r"--device 'cuda:0,cuda:0': cuda:0 named twice"),
    ("cuda,cuda:0", r"cuda:0 named twice"),  # "cuda" is GPU 0
    ("cpu,cuda:0", r"a target is spread over GPUs only"),
    ("cuda:0,", r"an empty entry in the list"),
    ("cuda:0,cuda:4", r"device cuda:4 \(--device\): only 4 GPU"),
    ("cuda:0,tpu", r"--device 'tpu' is not a device"),
])
def test_a_device_list_that_cannot_be_used_is_named(four_gpus, choice, message):
    with pytest.raises(InputError, match=message):
        resolve_devices(choice)


def test_spreading_fills_the_gpus_in_order_and_keeps_the_drafts_share_on_the_first():
    free = {0: 80 * GIB, 3: 40 * GIB}
    plan = spread_placement(["cuda:0", "cuda:3"], reserve_first_bytes=6 * GIB, free_bytes=free.__getitem__)
    assert plan == Spread(devices=("cuda:0", "cuda:3"),
                          max_memory={0: int(80 * GIB * WEIGHT_SHARE) - 6 * GIB, 3: int(40 * GIB * WEIGHT_SHARE)})
    assert list(plan.max_memory) == [0, 3]  # the order accelerate fills them in
    with pytest.raises(InputError, match=r"cuda:0 has 7.2 GiB for weights and the draft needs 8.0 GiB"):
        spread_placement(["cuda:0", "cuda:1"], reserve_first_bytes=8 * GIB,
                         free_bytes=lambda index: 8 * GIB)


def test_a_map_that_spills_onto_the_cpu_or_the_disk_is_refused():
    spilled = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1,
               "model.layers.2": "cpu", "model.norm": "disk", "lm_head": "disk"}
    with pytest.raises(InputError, match=r"the target does not fit on cuda:0, cuda:1: 3 of its modules "
                                         r"\(model.layers.2, model.norm, lm_head\) would run from cpu, disk"):
        check_placement(spilled, ["cuda:0", "cuda:1"])
    check_placement({"model.embed_tokens": 0, "model.layers.0": "cuda:1"}, ["cuda:0", "cuda:1"])


def test_the_placement_is_described_as_runs_of_layers():
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2.self_attn": 0, "model.layers.2.mlp": 1, "model.layers.3": "cuda:2",
                  "model.norm": 2, "lm_head": 2}
    assert describe_placement(device_map) == "layers 0-2 on cuda:0, 2 on cuda:1, 3 on cuda:2"
    assert describe_placement({"": 0}) == "whole on cuda:0"


@pytest.mark.integration
def test_the_plan_splits_smollm2_over_two_gpus_before_any_weight_is_read():
    """accelerate plans on the meta device, so GPUs need not exist: SmolLM2's float32
    weights (0.54 GB) over a first GPU allowed 300 MiB and a second allowed 1 GiB split by
    whole layers, in order; allowed 100 MiB each, the rest would go to the disk, which is refused."""
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.smollm2 import ensure_smollm2

    folder, cfg = ensure_smollm2(), TargetConfig(model="smollm2-135m-instruct", dtype="float32")
    split = plan_device_map(folder, Spread(("cuda:0", "cuda:1"), {0: 300 * 2**20, 1: GIB}), cfg)
    layers = [split[f"model.layers.{i}"] for i in range(30)]
    assert set(split.values()) == {0, 1} and layers == sorted(layers) and layers[0] == 0 and layers[-1] == 1
    assert split["model.embed_tokens"] == 0
    first = layers.count(0)
    assert describe_placement(split) == f"layers 0-{first - 1} on cuda:0, {first}-29 on cuda:1"
    with pytest.raises(InputError, match="the target does not fit on cuda:0, cuda:1: .* would run from .*disk"):
        plan_device_map(folder, Spread(("cuda:0", "cuda:1"), {0: 100 * 2**20, 1: 100 * 2**20}), cfg)


@pytest.mark.integration
def test_a_target_that_does_not_fit_is_refused_before_its_weights_load(monkeypatch):
    from transformers import AutoModelForCausalLM

    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read for a target that cannot fit")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(InputError, match="does not fit on cuda:0, cuda:1"):
        build_target(TargetConfig(model=smollm2.NAME, dtype="float32"), LAYERS,
                     placement=Spread(("cuda:0", "cuda:1"), {0: 50 * 2**20, 1: 50 * 2**20}))


# ------------------------------------------------------------------ the real target under dispatch

def _same_everywhere(whole, placed, device):
    """Features, cached verification and a speculative decode of ``placed`` equal ``whole``'s."""
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 31, 2, 198, 1, 4093, 198]])
    a, b = whole.features(ids), placed.features(ids)
    assert b.aux.device == torch.device(device) and b.final.device == torch.device(device)
    assert torch.equal(a.aux, b.aux.cpu()) and torch.equal(a.final, b.final.cpu())

    sessions = [TargetSession(t.model, LAYERS) for t in (whole, placed)]
    outs = [s.prefill(ids[0, :8].tolist()) for s in sessions]
    outs += [s.extend(ids[0, 8:].tolist()) for s in sessions]
    for s in sessions:
        s.crop(10)
    outs += [s.extend(ids[0, 10:].tolist()) for s in sessions]  # after a crop, as a rejected round
    for (logits_a, aux_a), (logits_b, aux_b) in zip(outs[::2], outs[1::2], strict=True):
        assert torch.equal(logits_a, logits_b.cpu()) and torch.equal(aux_a, aux_b.cpu())

    draft = smollm2_draft(whole, LAYERS)
    results = []
    for target, dev in ((whole, "cpu"), (placed, device)):
        proposer = DraftProposer(draft.to(dev), temperature=0.0, generator=torch.Generator())
        results.append(speculative_decode(TargetSession(target.model, LAYERS), ids[0].tolist(), proposer,
                                          DecodeSettings(max_new_tokens=24)))
    assert results[0].tokens == results[1].tokens
    assert [r.num_accepted for r in results[0].rounds] == [r.num_accepted for r in results[1].rounds]


@pytest.mark.integration
def test_smollm2_dispatched_by_accelerate_gives_the_whole_models_features_and_rounds():
    """Half the layers offloaded to disk: they run under accelerate's hooks (weights brought in
    for each forward), the way layers on another GPU run, and every figure the evaluator reads
    is unchanged, bit for bit."""
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.hf_backend import HFTarget
    from draftforge.splitserve.target import build_target

    cfg = TargetConfig(model=smollm2.NAME, dtype="float32")
    whole = build_target(cfg, LAYERS)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map |= {f"model.layers.{i}": "cpu" if i < 15 else "disk" for i in range(30)}
    placed = HFTarget.from_folder(smollm2.ensure_smollm2(), LAYERS, cfg, device_map=device_map)
    assert hasattr(placed.model.model.layers[20], "_hf_hook") and not hasattr(whole.model.model.layers[20], "_hf_hook")
    assert describe_placement(placed.model.hf_device_map) == "layers 0-14 on cpu, 15-29 on disk"
    _same_everywhere(whole, placed, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_smollm2_split_over_two_gpus_gives_the_whole_models_features_and_rounds():
    """The plan draftforge eval uses, with the first GPU's share cut so that the layers really
    split: features gathered on the first GPU and decoding as the whole model's on that GPU
    (float32; kernels chosen per device could differ in the last bits, hence the tolerance
    on the features and the comparison of tokens, not bits)."""
    from draftforge.splitserve import smollm2
    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.target import build_target

    cfg = TargetConfig(model=smollm2.NAME, dtype="float32")
    whole = build_target(cfg, LAYERS, device="cuda:0")
    free = {0: int(0.4 * 2**30 / WEIGHT_SHARE), 1: torch.cuda.mem_get_info(1)[0]}  # ~0.4 GiB of 0.54 GiB
    plan = spread_placement(["cuda:0", "cuda:1"], reserve_first_bytes=0, free_bytes=free.__getitem__)
    placed = build_target(cfg, LAYERS, device="cuda:0", placement=plan)
    where = describe_placement(placed.model.hf_device_map)
    assert "on cuda:0" in where and "on cuda:1" in where, where
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 31, 2, 198, 1, 4093, 198]])
    a, b = whole.features(ids), placed.features(ids)
    assert b.aux.device == torch.device("cuda:0")
    torch.testing.assert_close(a.aux, b.aux, rtol=1e-4, atol=1e-4)
    draft = smollm2_draft(whole, LAYERS).to("cuda:0")
    results = [speculative_decode(TargetSession(t.model, LAYERS), ids[0].tolist(),
                                  DraftProposer(draft, temperature=0.0, generator=torch.Generator()),
                                  DecodeSettings(max_new_tokens=24)) for t in (whole, placed)]
    assert results[0].tokens == results[1].tokens
