"""SplitServe pieces: topology, order, assignment, packing, accounting, split checks, dry run, wire."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from splitserve_helpers import run_workers, tiny_recipe

from draftforge.config import RecipeError, load_recipe
from draftforge.splitserve.accounting import Meter, recommend_split, side_summary
from draftforge.splitserve.consumer import stream_pack
from draftforge.splitserve.producer import (
    Topology,
    epoch_id,
    epoch_order,
)
from draftforge.splitserve.roles import check_split, split_problems
from draftforge.train.sample import Sample, pack

# --------------------------------------------------------------------------- topology


@pytest.mark.parametrize("num_p,num_r", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 2), (5, 2), (4, 4)])
def test_topology_links_are_consistent(num_p, num_r):
    producers = tuple(range(num_p))
    trainers = tuple(range(num_p, num_p + num_r))
    topo = Topology(producers, trainers)
    links = {(p, r) for p in producers for r in topo.dests(p)}
    assert links == {(p, r) for r in trainers for p in topo.sources(r)}
    for r in trainers:
        assert topo.sources(r), "every trainer has a producer"
    for p in producers:
        assert topo.dests(p), "every producer has a trainer"
    # one side of every link is exclusive: no trainer waits on two producers that share trainers
    for p in producers:
        assert len(topo.dests(p)) == 1 or all(len(topo.sources(r)) == 1 for r in topo.dests(p))
    # every trainer gets the same share (they step in lockstep; with 3 producers and 2
    # trainers one trainer used to get 2/3 and a finite run ended with a third untrained)
    total = num_p * num_r * 10
    owned = Counter(topo.producer_of(n) for n in range(total))
    if num_p <= num_r:  # a producer owns its trainers' shares and splits them by micro-batches
        for p in producers:
            assert owned[p] == len(topo.dests(p)) * total // num_r
    else:  # a trainer's share goes round its producers
        for r in trainers:
            assert sum(owned[p] for p in topo.sources(r)) == total // num_r
        if num_p % num_r == 0:
            assert set(owned.values()) == {total // num_p}


def test_epoch_order_is_a_seeded_permutation():
    first = epoch_order(50, seed=3, epoch=0)
    assert sorted(first) == list(range(50))
    assert first == epoch_order(50, seed=3, epoch=0)
    assert first != epoch_order(50, seed=3, epoch=1)
    assert first != epoch_order(50, seed=4, epoch=0)
    assert epoch_id("x", 0) == "x" and epoch_id("x", 2) == "x#e2"


# --------------------------------------------------------------------------- packing


def _sample(i: int, length: int) -> Sample:
    return Sample(f"s{i}", torch.arange(length), torch.ones(length, dtype=torch.bool),
                  torch.zeros(length, 2), torch.zeros(length, 1))


@pytest.mark.parametrize("budget", [1, 40, 100, 333])
def test_stream_pack_matches_pack(budget):
    rng = random.Random(budget)
    samples = [_sample(i, rng.randint(1, 90)) for i in range(60)]
    streamed = [[s.sample_id for s in b] for b in stream_pack(iter(samples), budget)]
    reference = [[s.sample_id for s in b] for b in pack(samples, budget)]
    assert streamed == reference


def test_stream_pack_yields_before_the_stream_ends():
    def endless():
        i = 0
        while True:
            yield _sample(i, 10)
            i += 1

    batches = stream_pack(endless(), 30)
    assert [s.sample_id for s in next(batches)] == ["s0", "s1", "s2"]
    assert [s.sample_id for s in next(batches)] == ["s3", "s4", "s5"]


# --------------------------------------------------------------------------- accounting


def test_recommend_split_hand_values():
    # producer 100 tok/s per rank, trainer 300: 1 target feeds at most 100, 2 targets 200 vs 2*300...
    # world 4: T=1 -> min(100, 900)=100; T=2 -> min(200, 600)=200; T=3 -> min(300, 300)=300
    assert recommend_split(4, 100.0, 300.0) == (3, 1, 300.0)
    assert recommend_split(4, 300.0, 100.0) == (1, 3, 300.0)
    assert recommend_split(2, 5.0, 1.0) == (1, 1, 1.0)
    # one producer is a tensor-parallel group: world 8, 100 tok/s a group of 2, trainers 100 each.
    # T=2 -> min(100, 600); T=4 -> min(200, 400); T=6 -> min(300, 200): 4 + 4 at 200 (counting
    # target ranks as producers said 6 + 2 at 200, or 4 + 4 at 400 with the target the faster side)
    assert recommend_split(8, 100.0, 100.0, tensor_parallel=2) == (4, 4, 200.0)
    assert recommend_split(8, 100.0, 25.0, tensor_parallel=2) == (2, 6, 100.0)


def test_slower_side_counts_producers_not_target_ranks():
    """4 target ranks in tensor-parallel pairs are 2 producers: 2 x 100 against 4 trainers x 100."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    acc = ConsumerAccounting(world=8, num_target=4, credits=4, tensor_parallel=2)
    acc.on_producer_stats(0, {"busy_s": 1.0, "idle_s": 0.0, "wall_s": 1.0, "tokens": 100})
    acc.on_take(depth=2, tokens=100, waited_s=0.0)
    acc.on_step({"compute_s": 1.0, "wait_s": 0.0})
    assert "slower side: target; recommended split for 8 ranks: 4 target + 4 trainer" in acc.summary_text()


def test_slower_side_compares_the_groups_not_one_rank_of_each():
    """1 target at 100 tok/s feeds 3 trainers at 50 tok/s each: the target group (100) is
    the slower side although one trainer rank (50) is slower than one target rank."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    acc = ConsumerAccounting(world=4, num_target=1, credits=4)
    acc.on_producer_stats(0, {"busy_s": 1.0, "idle_s": 0.0, "wall_s": 1.0, "tokens": 100})
    acc.on_take(depth=2, tokens=100, waited_s=0.0)
    acc.on_step({"compute_s": 2.0, "wait_s": 0.0})
    snap = acc.snapshot()
    assert snap["producer"]["capacity_tok_s"] == 100.0 and snap["consumer"]["capacity_tok_s"] == 50.0
    assert snap["recommended"] == {"target_ranks": 1, "trainer_ranks": 3, "expected_tok_s": 100.0}
    assert "slower side: target; recommended split for 4 ranks: 1 target + 3 trainer" in acc.summary_text()
    acc = ConsumerAccounting(world=4, num_target=2, credits=4)
    acc.on_producer_stats(0, {"busy_s": 1.0, "idle_s": 0.0, "wall_s": 1.0, "tokens": 100})
    acc.on_take(depth=2, tokens=100, waited_s=0.0)
    acc.on_step({"compute_s": 2.0, "wait_s": 0.0})
    assert "slower side: trainer" in acc.summary_text()  # 2 x 100 against 2 x 50


def test_the_accounting_says_when_the_credits_hold_less_than_a_step():
    """Target and trainer each idle a quarter of 10 s while a step takes 32 samples against
    4 credits: the summary says the credits keep the target from working ahead and how
    many to give; with each side busy (or credits above a step) it says nothing of it."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    def accounting(credits: int, trainer_wait: float) -> ConsumerAccounting:
        acc = ConsumerAccounting(world=2, num_target=1, credits=credits)
        acc.started -= 10.0  # ten seconds of wall
        acc.on_producer_stats(0, {"busy_s": 7.5, "idle_s": 2.5, "wall_s": 10.0, "tokens": 6400})
        for _ in range(64):
            acc.on_take(depth=1, tokens=100, waited_s=0.0)
        acc.on_step({"compute_s": 5.0, "wait_s": trainer_wait})
        acc.on_step({"compute_s": 2.5, "wait_s": trainer_wait})
        return acc

    text = accounting(4, 1.25).summary_text()
    assert text.splitlines()[-1] == (
        "  both sides waited (target idle 25%, trainer idle 25%): a step took 32.0 samples and "
        "the trainer's credits hold 4, so the target cannot work a step ahead; raise "
        "split.max_in_flight to about 64")
    assert "both sides waited" not in accounting(4, 0.25).summary_text()  # trainer idle 5 %
    assert "both sides waited" not in accounting(40, 1.25).summary_text()  # 40 credits > 32


def test_max_in_flight_defaults_to_twice_a_steps_samples(tmp_path):
    """Unset, the credits are twice the full-length samples an optimizer step packs
    (token_budget // max_length x grad_accum), at least 4 and at least the producers;
    tiny-debug (4096 // 128 = 32 a step) had 4 and its trainer idled 20 %."""
    from splitserve_helpers import tiny_recipe

    def credits(overrides: dict) -> int:
        recipe = tiny_recipe(tmp_path, overrides={"split.max_in_flight": None, **overrides})
        return load_recipe(recipe).split.max_in_flight

    assert credits({}) == 2 * (256 // 96)  # 4: at least 4 either way
    assert credits({"split.token_budget": 960, "data.max_length": 96}) == 20
    assert credits({"split.token_budget": 960, "data.max_length": 96, "train.grad_accum": 3}) == 60
    assert credits({"split.token_budget": 96, "data.max_length": 96}) == 4
    assert credits({"split.target_ranks": [0, 1, 2, 3, 4, 5], "split.trainer_ranks": [6]}) == 6
    assert credits({"split.max_in_flight": 7}) == 7  # given: kept
    tiny_debug = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    assert load_recipe(tiny_debug).split.max_in_flight == 64


def test_a_source_reporting_late_does_not_make_an_interval_negative():
    """Two targets feed a trainer; the second first reports after the first interval. The
    producer figures are means over both from the start, so the next interval's busy time
    is the growth of that mean: (3 + 2) / 2 - 1 / 2 = 2, never negative."""
    from draftforge.splitserve.accounting import ConsumerAccounting

    acc = ConsumerAccounting(world=3, num_target=2, credits=4, num_sources=2)
    acc.on_producer_stats(0, {"busy_s": 1.0, "idle_s": 0.0, "wall_s": 1.0, "tokens": 10})
    first = acc._totals()
    assert first["p_busy_s"] == 0.5
    acc.on_producer_stats(0, {"busy_s": 3.0, "idle_s": 0.0, "wall_s": 3.0, "tokens": 30})
    acc.on_producer_stats(1, {"busy_s": 2.0, "idle_s": 0.0, "wall_s": 2.0, "tokens": 20})
    interval = acc.snapshot(since=first)["producer"]
    assert interval["busy_s"] == 2.0 and interval["tokens"] == 20


def test_meter_and_shares(monkeypatch):
    """On a hand-driven clock: each block's time adds to its reason's total, an exception
    inside a block is timed too, and the wall time runs from start() to stop()."""
    from types import SimpleNamespace

    from draftforge.splitserve import accounting

    clock = [10.0]
    monkeypatch.setattr(accounting, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    meter = Meter()
    meter.start()
    for took in (2.0, 0.5):
        with meter.busy("features"):
            clock[0] += took
    with pytest.raises(KeyError), meter.busy("features"):
        clock[0] += 0.25
        raise KeyError("a failed block")
    clock[0] += 4.0  # between blocks: neither busy nor idle
    with meter.idle("credits"):
        clock[0] += 1.0
    meter.add_tokens(600)
    clock[0] += 0.25
    meter.stop()
    clock[0] += 100.0  # after stop(): not wall time
    assert dict(meter.busy_by) == {"features": 2.75} and dict(meter.idle_by) == {"credits": 1.0}
    assert meter.wire_stats() == [2_750_000, 1_000_000, 600, 8_000_000]
    assert meter.summary()["busy_share"] == pytest.approx(2.75 / 8.0)
    summary = side_summary(3.0, 1.0, 5.0, 600)
    assert summary["busy_share"] == pytest.approx(0.6)
    assert summary["idle_share"] == pytest.approx(0.2)
    assert summary["rate_tok_s"] == pytest.approx(120.0)
    assert summary["capacity_tok_s"] == pytest.approx(200.0)


# --------------------------------------------------------------------------- split checks


def test_split_checks(tmp_path):
    recipe = tiny_recipe(tmp_path)
    cfg = load_recipe(recipe)
    assert split_problems(cfg, world_size=2, cuda_devices=0) == []
    bad = load_recipe(recipe, ["split.trainer_ranks=[1,2]"])
    problems = split_problems(bad, cuda_devices=0)
    assert any("train.strategy 'single'" in p and "2 trainer ranks" in p for p in problems)
    problems = split_problems(cfg, world_size=3, cuda_devices=0)
    assert any("3 processes were started" in p for p in problems)
    gpu = load_recipe(recipe, ["split.trainer_devices=[0]"])
    assert any("CUDA GPUs and none is visible" in p for p in split_problems(gpu, cuda_devices=0))
    auto = load_recipe(recipe, ["train.device=auto", "split.comm_backend=auto"])
    crowded = [p for p in split_problems(auto, cuda_devices=1) if "NCCL refuses two ranks" in p]
    assert crowded and "2 ranks on this node" in crowded[0] and "1 GPU(s) are visible" in crowded[0]
    assert not [p for p in split_problems(auto, cuda_devices=2) if "NCCL refuses" in p]
    cpu = load_recipe(recipe, ["train.device=cpu", "split.comm_backend=auto"])
    assert not [p for p in split_problems(cpu, cuda_devices=1) if "NCCL refuses" in p]
    both = load_recipe(recipe, ["split.trainer_devices=[0]", "split.target_devices=[0]"])
    assert any("GPUs [0] are in both" in p for p in split_problems(both, cuda_devices=2))
    tp = load_recipe(recipe, ["split.target_ranks=[0,1]", "split.trainer_ranks=[2]",
                              "split.target_tensor_parallel=2"])
    assert any("tensor-parallel target engine" in p for p in split_problems(tp, cuda_devices=0))
    small = load_recipe(recipe, ["target.shape.vocab_size=128", "draft.mask_token_id=3"])
    assert any("has no tokenizer" in p for p in split_problems(small, cuda_devices=0))
    nccl = load_recipe(recipe, ["split.comm_backend=nccl"])
    assert any("train.device is cpu" in p for p in split_problems(nccl, cuda_devices=1))
    with pytest.raises(RecipeError, match="trainer ranks"):
        check_split(bad, cuda_devices=0)


def test_every_rank_gets_its_own_gpu_or_the_split_is_refused(tmp_path):
    """A device list for one group leaves the other on LOCAL_RANK: the two must not meet on one
    GPU, nor may one list repeat a GPU; device lists under gloo would be ignored."""
    recipe = tiny_recipe(tmp_path)

    def problems(*overrides, gpus=2):
        backend = [] if any(o.startswith("split.comm_backend=") for o in overrides) else ["split.comm_backend=auto"]
        cfg = load_recipe(recipe, ["train.device=cuda", *backend, *overrides])
        return split_problems(cfg, world_size=2, cuda_devices=gpus)

    # the target named on GPU 1; the trainer (rank 1) would take LOCAL_RANK 1 too
    shared = [p for p in problems("split.target_devices=[1]") if "share GPU" in p]
    assert shared == [shared[0]] and "ranks [0, 1] would share GPU 1" in shared[0]
    assert not [p for p in problems("split.target_devices=[0]") if "share GPU" in p]  # rank 1 on GPU 1
    assert problems("split.target_devices=[1]", "split.trainer_devices=[0]") == []
    # a group's list repeating a GPU, and a LOCAL_RANK GPU that does not exist
    two = load_recipe(recipe, ["train.device=cuda", "split.target_ranks=[0,1]", "split.trainer_ranks=[2]",
                               "split.target_devices=[0,0]", "split.trainer_devices=[1]"])
    assert any("ranks [0, 1] would share GPU 0" in p for p in split_problems(two, world_size=3, cuda_devices=2))
    assert any("would take GPU 1 (LOCAL_RANK), which does not exist" in p
               for p in problems("split.target_devices=[0]", gpus=1))
    # gloo: the lists would place nothing
    ignored = problems("split.comm_backend=gloo", "split.trainer_devices=[1]")
    assert any("samples go over gloo here" in p for p in ignored)


def test_split_errors_name_the_recipe_line_or_the_override(tmp_path):
    """The checks made at launch (world size, GPUs, restarts) lead each problem with where its
    key was set, like the checks made while loading."""
    recipe = tiny_recipe(tmp_path, overrides={"split.restart_target": True, "train.resume": "never"})
    lines = recipe.read_text().splitlines()
    line_of = {text.strip().split(":")[0]: n for n, text in enumerate(lines, 1)}
    with pytest.raises(RecipeError) as caught:
        check_split(load_recipe(recipe), world_size=2, cuda_devices=0)
    assert caught.value.problems == [
        f"{recipe}:{line_of['restart_target']}: split.restart_target: a restarted job continues "
        "from the newest checkpoint, which needs train.resume: auto (it is 'never'); set "
        "train.resume: auto or split.restart_target: false"]
    with pytest.raises(RecipeError) as caught:
        check_split(load_recipe(recipe, ["split.comm_backend=nccl", "train.resume=auto"]),
                    world_size=2, cuda_devices=1)
    assert caught.value.problems[0].startswith(
        "command line 'split.comm_backend=nccl': split.comm_backend: nccl moves samples")
    with pytest.raises(RecipeError) as caught:  # a derived key: the section's line
        check_split(load_recipe(recipe, ["train.resume=auto"]), world_size=3, cuda_devices=0)
    assert caught.value.problems[0].startswith(f"{recipe}:{line_of['split']}: split.world_size: ")


def test_setup_mistakes_are_refused_before_any_rank_starts(tmp_path, capsys):
    """Each of these ended in a rank's or the launcher's traceback, followed by advice to
    rerun the same command to resume: a trainer on cuda without a GPU, an output_dir that is
    a file or under one, and a --master-addr this machine cannot listen on."""
    from draftforge.cli import main as cli_main
    from draftforge.errors import InputError
    from draftforge.splitserve.launch import preflight
    from draftforge.splitserve.supervisor import host_store

    recipe = tiny_recipe(tmp_path)
    with pytest.raises(RecipeError) as caught:
        check_split(load_recipe(recipe, ["train.device=cuda"]), world_size=2, cuda_devices=0)
    assert caught.value.problems == [
        "command line 'train.device=cuda': train.device: cuda, but no CUDA GPU is visible on this "
        "machine; use train.device=cpu (or auto, which takes a GPU when there is one)"]
    check_split(load_recipe(recipe, ["train.device=cuda"]), world_size=2, cuda_devices=2)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a run")
    for out, where in ((a_file, "is a file"), (a_file / "run", f"is under {a_file}, a file")):
        with pytest.raises(InputError) as err:
            preflight(load_recipe(recipe, [f"train.output_dir={out}"]))
        assert str(err.value) == f"train.output_dir: {out} {where}; name a folder for the run"
    for host in ("no-such-host.invalid", "192.0.2.1"):  # unresolvable; TEST-NET, not this machine
        with pytest.raises(InputError, match=f"^--master-addr {host}: the rendezvous cannot listen "
                           r"there \(.+\); give an address of this machine \(default 127.0.0.1\)$"):
            host_store(host)
    assert cli_main(["train", str(recipe), "--master-addr", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert "--master-addr no-such-host.invalid: the rendezvous cannot listen there" in err
    assert "Traceback" not in err


def test_a_failed_job_offers_to_resume_only_from_a_checkpoint(tmp_path, capsys, monkeypatch):
    """A job that failed before its first checkpoint has nothing to resume from: the launcher
    says the command starts over; with a checkpoint it says where it resumes."""
    from draftforge.splitserve.launch import main as train_main

    recipe = tiny_recipe(tmp_path)
    monkeypatch.setattr("draftforge.splitserve.launch.run_ranks", lambda *a, **k: 1)
    assert train_main([str(recipe)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "draftforge train: the job failed (exit status 1); the messages above name the failing "
        "rank. No checkpoint was written: once the cause is fixed, the same command starts over.")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "trainer_state.json").write_text("{}")
    monkeypatch.setattr("draftforge.splitserve.launch.preflight", lambda cfg, **kwargs: None)
    assert train_main([str(recipe)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"Rerun the same command to resume from the newest checkpoint in {tmp_path / 'run'} "
        "(train.resume=auto).")


# --------------------------------------------------------------------------- dry run


def test_dry_run_reports_parameters_and_memory(tmp_path, capsys):
    from draftforge.splitserve.launch import main
    from draftforge.splitserve.registry import resolve_target_shape
    from draftforge.train.config import build_dspark_config
    from draftforge.train.model import DSparkDraft

    recipe = tiny_recipe(tmp_path)
    assert main([str(recipe), "--dry-run", "train.steps=3"]) == 0
    out = capsys.readouterr().out
    cfg = load_recipe(recipe)
    model = DSparkDraft(build_dspark_config(cfg.draft, resolve_target_shape(cfg.target)))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"draft parameters: {total:,} with embeddings, {trainable:,} without" in out
    assert "memory estimate per target rank:" in out
    assert "memory estimate per trainer rank:" in out
    assert "AdamW moments" in out and "steps: 3" in out
    assert "target rank 0 feeds trainer ranks [1]" in out


def test_dry_run_counts_two_target_copies_with_the_sglang_backend(tmp_path):
    """The SGLang backend runs a generation engine and a feature runner, each holding the
    weights, side by side on the target's GPU; the hf backend holds one copy."""
    from draftforge.splitserve.dry_run import sglang_pool_note, target_estimate, target_parameters
    from draftforge.splitserve.registry import resolve_target_shape

    hf = load_recipe(tiny_recipe(tmp_path))
    sglang = load_recipe(tiny_recipe(tmp_path), ["target.backend=sglang", "target.dtype=bfloat16",
                                                 "target.sglang_mem_fraction=0.7",
                                                 "split.comm_backend=nccl"])  # on a GPU (r36)
    params = target_parameters(resolve_target_shape(hf.target))
    hf_weights = dict(target_estimate(hf).items)
    sg_weights = dict(target_estimate(sglang).items)
    assert [v for n, v in hf_weights.items() if n.startswith("weights")] == [params * 4]
    assert [v for n, v in sg_weights.items() if n.startswith("weights x2")] == [2 * params * 2]
    assert sglang_pool_note(hf) == ""
    assert "target.sglang_mem_fraction = 0.7 of its memory" in sglang_pool_note(sglang)


def test_dry_run_ling_scale_on_meta(tmp_path):
    """A Ling-sized draft is counted without allocating its weights."""
    from draftforge.splitserve.dry_run import draft_parameter_counts, trainer_estimate

    recipe = tiny_recipe(tmp_path, overrides={
        "target.shape": {"num_hidden_layers": 32, "hidden_size": 8192, "vocab_size": 49152,
                         "num_attention_heads": 64, "num_key_value_heads": 8,
                         "intermediate_size": 24576},
        "draft.hidden_size": 8192, "draft.num_attention_heads": 64, "draft.num_key_value_heads": 8,
        "draft.intermediate_size": 24576, "draft.num_hidden_layers": 2,
        "draft.target_layer_ids": [1, 8, 15, 22, 29],
    })
    cfg = load_recipe(recipe)
    with_emb, without = draft_parameter_counts(cfg)
    assert with_emb - without == 2 * 49152 * 8192
    # by hand (H 8192, 64 heads of 128, 8 KV heads, MLP 24576, vocabulary 49152, Markov rank 8):
    # per layer q and o 2 * H * 8192, k and v 2 * H * 1024, MLP 3 * H * 24576, two RMS norms
    # 2 * H and the q/k norms 2 * 128; fc 5H * H, hidden_norm and norm 2 * H; the Markov head's
    # W1 and W2 2 * V * 8; the confidence head reads [hidden; Markov embedding]: H + 8 weights, a bias
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 24576 + 2 * 8192 + 2 * 128
    assert without == 2 * layer + 5 * 8192 * 8192 + 2 * 8192 + 2 * 49152 * 8 + (8192 + 8 + 1)
    estimate = trainer_estimate(cfg, with_emb, without)
    items = dict(estimate.items)  # strategy single, float32
    assert items["trainable params (fp32)"] == items["gradients (fp32)"] == without * 4
    assert items["AdamW moments (fp32)"] == without * 8
    assert items["frozen embed + lm_head"] == (with_emb - without) * 4
    assert estimate.total > without * 16 + (with_emb - without) * 4


def test_dry_run_says_how_much_more_short_samples_can_take(tmp_path):
    """Budget 256, samples up to 96 tokens, 8 anchors each: 2 full-length samples make 16
    anchors; 51 samples of min_loss_tokens + 1 = 5 tokens fit, each with at most 4 anchors
    (a token with a supervised successor), so 204; the most is at 8 tokens: 32 samples of 7
    anchors, 224 (9 tokens: 28 x 8, as many), which the note gives. An audit's run packed
    4-5 short samples where the estimate assumed 2."""
    from draftforge.splitserve.dry_run import anchors_per_micro_batch, short_sample_note

    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"data.min_loss_tokens": 4}))
    assert (cfg.split.token_budget, cfg.data.max_length, cfg.train.num_anchors) == (256, 96, 8)
    assert anchors_per_micro_batch(cfg, 96) == 16
    assert anchors_per_micro_batch(cfg, 5) == 204
    note = short_sample_note(cfg)
    assert anchors_per_micro_batch(cfg, 8) == anchors_per_micro_batch(cfg, 9) == 224
    assert "samples of data.max_length, 16 anchors a micro-batch; samples of 8 tokens could pack 224" in note
    longest = load_recipe(tiny_recipe(tmp_path, overrides={"data.min_loss_tokens": 95}))
    assert short_sample_note(longest) == ""  # no shorter sample fits more anchors


def test_tensor_parallel_groups_must_sit_on_consecutive_gpus_of_one_node(tmp_path, capsys):
    """SGLang places a tensor-parallel group on GPUs base_gpu_id, base_gpu_id + 1, ... of one
    machine: a split whose groups cannot be placed so is refused before anything starts."""
    from draftforge.splitserve.launch import main
    from draftforge.splitserve.roles import tensor_parallel_groups, tensor_parallel_problems

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "ling3-flash-dspark.yaml"
    cfg = load_recipe(recipe)
    assert tensor_parallel_groups(cfg.split) == [[0, 1, 2, 3]]
    assert tensor_parallel_problems(cfg.split, per_node=8) == []
    shuffled = load_recipe(recipe, ["split.target_devices=[0,2,1,3]"])
    problem, = tensor_parallel_problems(shuffled.split, per_node=8)
    assert "target ranks [0, 1, 2, 3] form one tensor-parallel group" in problem
    assert "GPUs [0, 2, 1, 3]" in problem and "[0, 1, 2, 3]" in problem
    split = load_recipe(recipe, ["split.target_ranks=[0,1,4,5]", "split.trainer_ranks=[2,3,6,7]",
                                 "split.target_devices=null", "split.trainer_devices=null",
                                 "split.target_tensor_parallel=2"]).split
    assert tensor_parallel_groups(split) == [[0, 1], [4, 5]]
    assert tensor_parallel_problems(split, per_node=8) == []  # node-local GPUs 0-1 and 4-5
    spans = tensor_parallel_problems(split.model_copy(update={"target_ranks": [0, 4, 1, 5]}),
                                     per_node=4)
    assert len(spans) == 2 and "group of target ranks [0, 4] spans nodes [0, 1]" in spans[0]
    gaps, = [p for p in split_problems(
        load_recipe(recipe, ["split.target_ranks=[0,2,1,3]", "split.trainer_ranks=[4,5,6,7]",
                             "split.target_devices=null", "split.trainer_devices=null"]),
        cuda_devices=8) if "tensor-parallel" in p]
    assert "they take their node-local GPUs [0, 2, 1, 3]" in gaps
    assert main([str(recipe), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 4" in out and "not built" not in out


@pytest.mark.distributed
def test_tensor_parallel_member_waits_for_its_leader(tmp_path):
    """Rank 1, a member of rank 0's group, waits (no engine of its own) until rank 0 is done;
    when rank 0 dies instead, rank 1 stops with PeerDied at once, not after a timeout."""
    from splitserve_helpers import run_on_ranks

    for name, leader_code in (("done", 0), ("dies", 7)):
        out = tmp_path / name / "result.json"
        out.parent.mkdir()
        codes, logs = run_on_ranks(
            f"import splitserve_helpers as h; h.tensor_parallel_member_worker({str(out)!r})", 3, 120)
        assert codes == [leader_code, 0, 0], logs
        result = [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in (1, 2)]
        member, trainer = result
        assert member["role"] == "target" and member["producers"] == [0]
        assert member["leader"] == 0 and member["in_group"] and not trainer["in_group"]
        assert member["waited_s"] >= 1.5  # the leader worked 2 s before releasing or dying
        if leader_code == 0:
            assert member["outcome"] == "released"
        else:
            assert member["outcome"].startswith("PeerDied: target rank 0 died or closed its")
            assert member["waited_s"] < 30


def test_train_refuses_wrong_nproc(tmp_path):
    from draftforge.errors import InputError
    from draftforge.splitserve.launch import main

    with pytest.raises(InputError, match="--nproc 3"):
        main([str(tiny_recipe(tmp_path)), "--nproc", "3", "--dry-run"])


# --------------------------------------------------------------------------- wire


@pytest.mark.distributed
def test_transport_roundtrip_is_exact(tmp_path):
    sender, receiver = run_workers("transport_worker", tmp_path / "wire")
    assert receiver["tensor_exact"] is True
    assert len(receiver["samples"]) == 3
    for checks in receiver["samples"]:
        assert all(checks.values()), checks
    assert sender["hello"] == [["", 3], ["a", 17], ["b-ü", 0], ["conv-0001#e2", None]]
    assert sender["ack"] == [3, [1]]


@pytest.mark.distributed
def test_backpressure_bounds_samples_in_flight(tmp_path):
    producer, trainer = run_workers("backpressure_worker", tmp_path / "bp")
    assert trainer["seen"] == [f"s{n}" for n in range(24)]
    assert producer["max_outstanding"] == 3  # the bound was reached ...
    assert max(producer["outstanding"]) <= 3  # ... and never exceeded
    assert trainer["max_depth"] <= 3
    assert max(trainer["depths"]) <= 3


def test_helpers_write_learnable_data(tmp_path):
    path = tiny_recipe(tmp_path)
    assert Path(path).is_file()
    assert (tmp_path / "convs.jsonl").read_text().count("\n") == 48


def test_drop_partial_line_cuts_only_an_unfinished_last_line(tmp_path):
    from draftforge.splitserve.accounting import drop_partial_line

    path = tmp_path / "accounting.jsonl"
    for text, kept in (('{"a": 1}\n{"b": 2}\n{"c"', '{"a": 1}\n{"b": 2}\n'),
                       ('{"a": 1}\n', '{"a": 1}\n'),
                       ('{"a"', ""),
                       ("", "")):
        path.write_text(text)
        drop_partial_line(path)
        assert path.read_text() == kept, text



def test_a_local_target_folder_gives_its_rope_base_wherever_transformers_wrote_it(tmp_path):
    """transformers 5 writes the RoPE base under rope_parameters; a local folder's shape (and so
    the draft's default rope_theta) must read it there, not fall back to 10,000."""
    from transformers import LlamaConfig

    from draftforge.splitserve.config import TargetConfig
    from draftforge.splitserve.registry import KNOWN_TARGETS, resolve_target_shape

    known = KNOWN_TARGETS["smollm2-135m-instruct"]
    config = LlamaConfig(hidden_size=known.hidden_size, num_hidden_layers=known.num_hidden_layers,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         vocab_size=known.vocab_size, max_position_embeddings=8192,
                         tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})  # fmt: skip
    config.save_pretrained(tmp_path / "target")
    # every field of the registered shape but the parameter count, which a config.json lacks
    assert resolve_target_shape(TargetConfig(model=str(tmp_path / "target"))) == known.model_copy(
        update={"num_parameters": None})
    old_style = {**config.to_dict(), "rope_theta": 50000.0}
    old_style.pop("rope_parameters", None)
    (tmp_path / "target" / "config.json").write_text(json.dumps(old_style))
    assert resolve_target_shape(TargetConfig(model=str(tmp_path / "target"))).rope_theta == 50000.0


def test_a_named_regenerated_file_that_is_missing_is_refused_not_answered_silently(tmp_path):
    """data.regenerated_file names answers written ahead; mistyped, training used to answer
    the prompts itself during training (other answers, slower) without a word."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.errors import InputError
    from draftforge.splitserve.launch import preflight
    from draftforge.splitserve.producer import load_source_conversations

    recipe = tiny_recipe(tmp_path, overrides={"data.regenerate": True})
    cfg = load_recipe(recipe, [f"data.regenerated_file={tmp_path / 'answres.jsonl'}"])
    for check in (preflight, load_source_conversations):
        with pytest.raises(InputError, match=r"answres\.jsonl: no such file.*draftforge data regenerate"):
            check(cfg)
    # unset, the default place is answered during training when it has no file
    conversations, regenerate_now = load_source_conversations(load_recipe(recipe))
    assert regenerate_now and conversations


def test_a_resumed_receive_rotation_continues_where_the_checkpoint_left_it(monkeypatch):
    """Three producers feed one trainer and the middle one runs out first: after that the
    rotation skips it, so a resume cannot start at (consumed % sources). It starts after the
    source of the last consumed sample, and every cut point then continues the same order."""
    import types

    from draftforge.splitserve import transport as T
    from draftforge.splitserve.roles import _rotation_start

    streams = {10: [f"a{i}" for i in range(6)], 11: [f"b{i}" for i in range(3)],
               12: [f"c{i}" for i in range(6)]}  # fmt: skip
    source = {x: src for src, xs in streams.items() for x in xs}

    def order(start, consumed):
        left = {src: [x for x in xs if x not in consumed] for src, xs in streams.items()}
        monkeypatch.setattr(T, "recv_sample", lambda src, **kw: left[src].pop(0) if left[src] else None)
        receiver, out = T.SampleReceiver(list(streams), credits=100, start=start), []
        while (item := receiver.get()) is not None:
            out.append(item[1])
        return out

    full = order(0, set())
    assert full[:9] == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"] and "b3" not in full
    strict = 0
    for k in range(1, len(full)):
        info = types.SimpleNamespace(extra={"last_source": source[full[k - 1]]}, consumed_ids=full[:k])
        assert full[:k] + order(_rotation_start(list(streams), info), set(full[:k])) == full, k
        old = types.SimpleNamespace(extra={}, consumed_ids=full[:k])  # a checkpoint without it
        strict += full[:k] + order(_rotation_start(list(streams), old), set(full[:k])) == full
    assert strict < len(full) - 1  # strict rotation gets some cut points wrong


def test_a_resumed_producer_skips_consumed_feature_batches_and_keeps_the_rest_identical(tmp_path):
    """Chunks holding a sample dropped for data.min_loss_tokens are never wholly consumed; a
    resume featurised every such chunk of every past epoch again. It now skips each feature
    batch whose samples were all consumed, and the rest keep their batches, so their features
    (which depend on the batch's padded length) are the uninterrupted run's."""
    import types

    from splitserve_helpers import tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import load_tokenizer

    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=64, overrides={
        "data.min_loss_tokens": 30, "data.regenerate": True, "target.generation.batch_size": 8}))

    class Engine:
        name = "fake"

        def __init__(self):
            self.tokenizer, self.feature_rows = load_tokenizer(cfg.target), 0

        def features(self, ids, mask):
            self.feature_rows += ids.shape[0]
            padded = ids.float()[..., None] + 0.001 * ids.shape[1]  # depends on the batch
            return types.SimpleNamespace(aux=padded.repeat(1, 1, 8), final=padded.repeat(1, 1, 4))

        def generate(self, conversations, settings):  # a third of the answers too short to train on
            return [("word " * (5 if len(c[-1]["content"]) % 3 == 0 else 60)).strip() for c in conversations]

    topology = build_topology(cfg.split)
    conversations, regenerate = load_source_conversations(cfg)

    def source(consumed=None):
        engine = Engine()
        return engine, SampleSource(cfg, engine, topology, 0, conversations=conversations,
                                    regenerate=regenerate, consumed=consumed)  # fmt: skip

    engine, full = source()
    stream, seen = full.samples(), []
    for sample in stream:
        seen.append(sample)
        if len(seen) > 1 and seen[-1].sample_id.endswith("#e3") and not seen[-2].sample_id.endswith("#e3"):
            break
    assert full.dropped_short > 0
    later = [next(stream) for _ in range(5)]
    consumed = {s.sample_id: s.num_tokens for s in seen[:-1]}  # three epochs, the fourth not begun
    resumed_engine, resumed = source(consumed)
    again = resumed.samples()
    for expected in [seen[-1], *later]:
        got = next(again)
        assert got.sample_id == expected.sample_id
        assert torch.equal(got.aux, expected.aux) and torch.equal(got.final, expected.final)
    # before its first new sample it featurised at most one batch of each chunk's last epoch
    assert resumed_engine.feature_rows < engine.feature_rows / 4
    assert resumed.skipped_consumed == len(consumed)
