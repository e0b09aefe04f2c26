"""The trainer in one process: packing, schedule, learning, records, checkpoints, exact resume, NaN steps."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config

from draftforge.train import checkpoint as ckpt
from draftforge.train.config import warmup_steps
from draftforge.train.sample import Sample, collate, pack
from draftforge.train.trainer import Trainer, lr_at


def _sample(sample_id: str, length: int, features: int = 3) -> Sample:
    ids = torch.arange(length)
    return Sample(sample_id, ids, torch.ones(length, dtype=torch.bool),
                  torch.full((length, features), float(length)), torch.zeros(length, 2))


def _trainer(tmp_path, **overrides) -> Trainer:
    return Trainer(model_config=tiny_model_config(), train=train_config(**overrides),
                   embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: test\n")


def test_pack_is_greedy_in_order_and_isolates_long_samples():
    samples = [_sample(f"s{i}", n) for i, n in enumerate([5, 3, 8, 2, 12, 1, 1])]
    batches = pack(samples, 10)
    # [5,3] pads to 2*5=10; adding 8 would pad to 24; [8,2] to 16; 12 alone; [1,1].
    assert [[s.sample_id for s in b] for b in batches] == [["s0", "s1"], ["s2"], ["s3"], ["s4"], ["s5", "s6"]]


def test_collate_right_pads_without_loss():
    batch = collate([_sample("a", 3), _sample("b", 5)])
    assert batch.sample_ids == ["a", "b"] and batch.lengths == [3, 5] and batch.num_tokens == 8
    assert batch.input_ids.shape == (2, 5) and batch.aux.shape == (2, 5, 3)
    assert batch.loss_mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert batch.aux[0, :3].eq(3.0).all() and batch.aux[0, 3:].eq(0).all()
    with pytest.raises(ValueError, match="positions"):
        Sample("bad", torch.arange(4), torch.ones(3, dtype=torch.bool), torch.zeros(4, 2), torch.zeros(4, 2))


def test_collate_builds_the_batch_where_the_samples_are():
    """Samples received over NCCL sit on the trainer's GPU: the batch must stay there rather
    than make a round trip through host memory (the meta device stands in for the GPU)."""
    meta = [Sample(s.sample_id, *(t.to("meta") for t in (s.input_ids, s.loss_mask, s.aux, s.final)))
            for s in (_sample("a", 3), _sample("b", 5))]
    batch = collate(meta)
    for tensor in (batch.input_ids, batch.loss_mask, batch.aux, batch.final):
        assert tensor.device.type == "meta"
    assert batch.aux.shape == (2, 5, 3) and batch.input_ids.dtype == torch.long


def test_step_record_matches_the_objective_on_the_same_batch_and_anchors(tmp_path):
    """A step's logged loss and tau are the objective's own, recomputed here from a copy of
    the draft before the update, on the same batch and the same anchors."""
    import copy

    from draftforge.train.blocks import sample_anchors
    from draftforge.train.trainer import anchor_seed

    trainer = _trainer(tmp_path)
    samples = chain_samples(3) + chain_samples(1, seed=1, min_len=5, max_len=6)  # too short for 6 anchors
    before = copy.deepcopy(trainer.model)
    record = trainer.train_step([samples])
    batch = collate(samples)
    gen = torch.Generator().manual_seed(anchor_seed(seed=trainer.train.seed, step=0, micro_step=0, rank=0))
    anchors, valid = sample_anchors(batch.loss_mask, trainer.train.num_anchors, gen)
    assert not valid.all()  # padding anchors: tau must leave their blocks out
    with torch.no_grad():
        out = before(batch.input_ids, batch.loss_mask, batch.aux, batch.final, anchors, valid,
                     objective=trainer.objective)
    assert record["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert record["tau"] == pytest.approx(out.expected_acceptance_length().item(), rel=1e-5)


def test_kl_term_is_in_the_step_loss_and_logged(tmp_path):
    """train.loss.kl_weight: the step's loss is the weighted sum of its logged parts, kl
    included; with the default 0 the kl column is 0 and the loss is the contract's."""
    from draftforge.train.config import LossConfig

    samples = chain_samples(3)
    for kl_weight in (0.0, 0.5):
        record = _trainer(tmp_path / str(kl_weight), loss=LossConfig(kl_weight=kl_weight)).train_step([samples])
        assert (record["kl"] > 0.1) == (kl_weight > 0)
        parts = 0.1 * record["ce"] + 0.9 * record["tv"] + record["bce"] + kl_weight * record["kl"]
        assert record["loss"] == pytest.approx(parts, rel=1e-5)


def test_accumulated_micro_batches_weigh_every_slot_alike(tmp_path):
    """grad_accum=2 over [A], [B] is one step on [A, B]: the objective divides by the whole
    step's weight sum, not each micro-batch by its own (a short answer would otherwise count
    as much as a long one). Every position is an anchor, so both see the same blocks."""
    short = chain_samples(1, seed=1, min_len=8, max_len=8)
    long = chain_samples(1, seed=2, min_len=40, max_len=40)
    together = _trainer(tmp_path / "one", num_anchors=200)
    split = _trainer(tmp_path / "two", num_anchors=200, grad_accum=2)
    for a, b in zip(together.model.state_dict().values(), split.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    one = together.train_step([short + long])
    two = split.train_step([short, long])
    assert two["block_tokens"] == one["block_tokens"]
    for key in ("loss", "ce", "tv", "bce", "tau", "grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
    for a, b in zip(together.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_plot_title_shows_the_runs_tau_beside_the_product_of_means():
    """Two blocks, c* = (1, 1) and (0.2, 0.2): tau is 1 + mean(2, 0.24) = 2.12, while the
    product of the slot means (0.6, 0.36) sums to 0.96; the title must not call that tau."""
    from draftforge.train.plots import acceptance_title

    assert acceptance_title([0.6, 0.6], 2.12) == "per-slot acceptance (tau = 2.120, 1 + sum of the line = 1.960)"
    assert acceptance_title([0.6, 0.6], None) == "per-slot acceptance (1 + sum of the line = 1.960)"


def test_lr_warmup_then_cosine_to_floor():
    train = train_config(steps=100, lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(0, train=train) == pytest.approx(0.1)
    assert lr_at(9, train=train) == pytest.approx(1.0)
    # Halfway through the 90 cosine steps: floor + (1 - floor) / 2.
    assert lr_at(55, train=train) == pytest.approx(0.55)
    assert lr_at(100, train=train) == pytest.approx(0.1)


def test_warmup_length_is_not_lengthened_by_float_noise():
    """0.07 * 100 is 7.000000000000001 in binary: 7 warmup steps, the 7th at the peak."""
    train = train_config(steps=100, lr=1.0, warmup_ratio=0.07)
    assert warmup_steps(train) == 7
    assert lr_at(5, train=train) == pytest.approx(6 / 7)
    assert lr_at(6, train=train) == pytest.approx(1.0)
    assert warmup_steps(train_config(steps=360, warmup_ratio=0.04)) == 15  # 14.4 rounds up


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    samples = chain_samples(96)
    trainer = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                      train=train_config(steps=250, lr=5e-3, warmup_ratio=0.05, checkpoint_interval=100,
                                         dtype="bfloat16"),
                      embeddings=target_embeddings(), run_dir=run_dir, recipe_yaml="name: test\n")
    result = trainer.fit(pack(samples, 160) * 20)
    return trainer, result, run_dir


def test_single_fit_lowers_the_loss(single_run):
    _, result, _ = single_run
    assert result.steps_run == 250 and result.stopped_reason == "steps_done"
    first, last = sum(result.losses[:10]) / 10, sum(result.losses[-10:]) / 10
    assert last < 0.7 * first, (first, last)
    assert result.summary["tau"] > 1.5, result.summary


def test_frozen_embeddings_never_change(single_run):
    trainer, _, _ = single_run
    embed, lm_head = target_embeddings()
    assert torch.equal(trainer.model.embed_tokens.weight.float(), embed.bfloat16().float())
    assert torch.equal(trainer.model.lm_head.weight.float(), lm_head.bfloat16().float())
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(trainer.model.lm_head.weight) not in optimised
    assert id(trainer.model.embed_tokens.weight) not in optimised


def test_run_dir_records_metrics_plot_and_summary(single_run):
    trainer, result, run_dir = single_run
    assert (run_dir / "config.yaml").read_text() == "name: test\n"
    [run] = json.loads((run_dir / "run.json").read_text())["segments"]
    import safetensors
    import transformers

    # each package's own idea of its version, not the metadata the record reads
    assert (run["versions"]["torch"], run["versions"]["transformers"], run["versions"]["safetensors"]) == (
        torch.__version__, transformers.__version__, safetensors.__version__)
    # optional packages too, null where not installed (round 58: sglang, wandb, tensorboard)
    import importlib.util

    for name in ("sglang", "wandb", "tensorboard"):
        assert (run["versions"][name] is None) == (importlib.util.find_spec(name) is None), name
    assert run["command"] and "git_revision" in run and run["strategy"] == "single"
    assert run["config"] == "config.yaml"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 251))
    for key in ("lr", "loss", "ce", "tv", "bce", "tau", "slot_acceptance", "tokens", "tokens_s",
                "grad_norm", "skipped_steps", "sample_ids", "wait_s", "compute_s"):
        assert key in records[0], key
    assert len(records[0]["slot_acceptance"]) == 4 and 1.0 <= records[-1]["tau"] <= 5.0
    assert [r["loss"] for r in records] == pytest.approx(result.losses)
    # Every sample id appears once per pass over the data, in order.
    ids = [i for r in records for i in r["sample_ids"]]
    assert ids[:96] == [f"s{i:04d}" for i in range(96)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 250 and summary["tokens"] == sum(r["tokens"] for r in records)
    png = (run_dir / "slot_acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert len(result.wait_s) == len(result.compute_s) == 250
    # keep_last=2: of the checkpoints at 100, 200 and 250, the last two remain.
    assert [p.name for p in ckpt.complete_checkpoints(run_dir)] == ["step_00000200", "step_00000250"]


class _Crash(RuntimeError):
    pass


def _run(tmp_path, samples, *, steps, crash_at=None, resume="never", **overrides):
    trainer = _trainer(tmp_path, steps=steps, resume=resume, checkpoint_interval=4, keep_last=5,
                       **overrides)
    info = trainer.resume()
    if info is not None:
        samples = [s for s in samples if s.sample_id not in info.all_consumed]
    records = []

    def on_step(record):
        records.append(record)
        if record["step"] == crash_at:
            raise _Crash

    try:
        trainer.fit(pack(samples, 90), on_step=on_step, extra_state=lambda: {"cursor": len(records)})
    except _Crash:
        pass
    return trainer, info, records


def test_resume_says_when_the_schedule_changed(tmp_path):
    """A checkpoint keeps the learning rate its run would use next; a resume under other
    schedule settings says what the next step's rate is now instead of jumping silently."""
    samples = chain_samples(60)
    _run(tmp_path, samples, steps=10, crash_at=6)  # checkpoint at step 4
    same = _trainer(tmp_path, steps=10, resume="auto", checkpoint_interval=4).resume()
    assert same.step == 4 and same.schedule_change == ""
    longer = _trainer(tmp_path, steps=30, lr=1e-2, resume="auto", checkpoint_interval=4).resume()
    before = lr_at(4, train=train_config(steps=10))
    now = lr_at(4, train=train_config(steps=30, lr=1e-2))
    assert longer.schedule_change == (
        f"the learning rate of step 5 is {now:.3e} under this recipe's schedule (train.lr 0.01, "
        f"steps 30, warmup_ratio 0.1, min_lr_ratio 0), where the checkpointed run's would have "
        f"been {before:.3e}; training continues on the new schedule"
    )


def test_resume_repeats_an_uninterrupted_run_exactly(tmp_path):
    samples = chain_samples(60)
    _, _, full = _run(tmp_path / "full", samples, steps=10)
    _, _, first = _run(tmp_path / "cut", samples, steps=10, crash_at=6)  # checkpoint at 4
    trainer, info, rest = _run(tmp_path / "cut", samples, steps=10, resume="auto")
    assert info.step == 4 and info.extra == {"cursor": 4}
    assert info.consumed_ids == [i for r in first[:4] for i in r["sample_ids"]]
    assert [r["step"] for r in rest] == list(range(5, 11))
    assert [r["sample_ids"] for r in rest] == [r["sample_ids"] for r in full[4:]]
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[4:]]  # bit-exact
    assert [r["grad_norm"] for r in rest] == [r["grad_norm"] for r in full[4:]]
    # The metrics file of the resumed run has each step once, the redone ones replaced.
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))


def test_resume_refuses_another_rope_theta_or_rms_norm_eps_and_accepts_a_longer_context(tmp_path):
    """rope_theta and rms_norm_eps change what the trained weights predict, so a checkpoint
    resumed under other values is refused with both named (another rope_theta used to be
    accepted silently); max_position_embeddings changes no weight or prediction and may grow."""
    _run(tmp_path, chain_samples(30), steps=4)  # checkpoint at step 4

    def resume(**model):
        return Trainer(model_config=tiny_model_config(**model), embeddings=target_embeddings(),
                       train=train_config(steps=8, resume="auto", checkpoint_interval=4),
                       run_dir=tmp_path, recipe_yaml="name: test\n").resume()

    with pytest.raises(ckpt.CheckpointError) as info:
        resume(rope_theta=1e6, rms_norm_eps=1e-5)
    message = str(info.value)
    assert "was written for a different draft" in message
    assert "rope_theta: checkpoint 10000.0, this recipe 1000000.0" in message
    assert "rms_norm_eps: checkpoint 1e-06, this recipe 1e-05" in message
    assert resume(max_position_embeddings=1024).step == 4


def test_resume_ignores_incomplete_checkpoints(tmp_path):
    samples = chain_samples(60)
    _run(tmp_path, samples, steps=10)  # checkpoints 4, 8, 10
    (tmp_path / "checkpoints" / "step_00000010" / "COMPLETE").unlink()
    shutil.copytree(tmp_path / "checkpoints" / "step_00000008", tmp_path / "checkpoints" / "step_00000009.tmp")
    assert ckpt.find_resume(tmp_path, "auto").name == "step_00000008"
    trainer = _trainer(tmp_path, steps=10, resume="auto")
    assert trainer.resume().step == 8
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        _trainer(tmp_path, steps=10, resume=str(tmp_path / "checkpoints" / "step_00000010")).resume()
    assert _trainer(tmp_path / "fresh", steps=10, resume="never").resume() is None


def test_checkpoint_files_are_safetensors_and_state_matches(tmp_path):
    trainer, _, _ = _run(tmp_path, chain_samples(30), steps=4)
    path = tmp_path / "checkpoints" / "step_00000004"
    saved = load_file(str(path / "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved[name], value), name
    state = ckpt.read_checked_state(path)
    assert state["step"] == 4 and len(state["consumed_ids"]) == 1
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in path.rglob("*"))


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    samples = chain_samples(40, nan_ids=(6, 12, 20))
    batches = pack(samples, 90)
    bad_steps = [i + 1 for i, b in enumerate(batches) if any(s.sample_id in ("s0006", "s0012", "s0020") for s in b)]
    trainer = _trainer(tmp_path, steps=50, max_bad_steps=1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.fit(batches)
    # Tolerates one bad step, stops at the second.
    assert result.stopped_reason == "max_bad_steps" and result.skipped_steps == 2
    assert result.step == bad_steps[1]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["skipped"]] == bad_steps[:2]
    assert all(r["loss"] is None for r in records if r["skipped"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    latest = ckpt.find_resume(tmp_path, "auto")
    assert latest.name == f"step_{bad_steps[1]:08d}"
    assert ckpt.read_checked_state(latest)["skipped_steps"] == 2


def test_a_run_stopped_by_bad_steps_continues_when_rerun_with_good_data(tmp_path):
    """max_bad_steps counts the steps of one run: resumed with data that no longer breaks it,
    training goes on to the end (the checkpoint's lifetime count stopped it after one step)."""
    samples = chain_samples(40, nan_ids=(6, 12))
    first = _trainer(tmp_path, steps=12, max_bad_steps=1, checkpoint_interval=100).fit(pack(samples, 90))
    assert first.stopped_reason == "max_bad_steps" and first.skipped_steps == 2
    trainer = _trainer(tmp_path, steps=12, max_bad_steps=1, checkpoint_interval=100, resume="auto")
    info = trainer.resume()
    good = [s for s in chain_samples(40) if s.sample_id not in info.all_consumed]
    result = trainer.fit(pack(good, 90))
    assert result.stopped_reason != "max_bad_steps" and result.step == 12
    assert result.skipped_steps == 2  # the lifetime count is still recorded


def test_rerunning_a_finished_run_keeps_its_summary(tmp_path):
    _trainer(tmp_path, steps=4, checkpoint_interval=100).fit(pack(chain_samples(20), 90))
    summary = (tmp_path / "summary.json").read_text()
    trainer = _trainer(tmp_path, steps=4, checkpoint_interval=100, resume="auto")
    trainer.resume()
    assert trainer.fit(pack(chain_samples(20), 90)).steps_run == 0
    assert (tmp_path / "summary.json").read_text() == summary


def test_a_resumed_run_summarises_the_same_last_steps_as_an_uninterrupted_run(tmp_path):
    """The summary's loss, tau and per-slot acceptance average the last log_interval steps and
    its plot starts from step 1's acceptance, whether or not the run was resumed in between."""
    samples = chain_samples(60)
    _run(tmp_path / "full", samples, steps=10, log_interval=8)
    _run(tmp_path / "cut", samples, steps=10, log_interval=8, crash_at=6)  # checkpoint at 4
    _run(tmp_path / "cut", samples, steps=10, log_interval=8, resume="auto")  # steps 5-10 only
    full, cut = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("full", "cut"))
    assert cut["steps_this_run"] == 6
    for key in ("loss", "tau", "slot_acceptance"):
        assert cut[key] == full[key], key
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert full["tau"] == pytest.approx(sum(r["tau"] for r in records[-8:]) / 8, rel=1e-12)


def test_a_rerun_that_finds_no_summary_writes_it_from_the_logged_steps(tmp_path):
    """Stopped between its final checkpoint and its summary (finite data ends there and the
    trainer waits for the end), a run's rerun trains no step and still writes the summary."""
    _trainer(tmp_path, steps=4, checkpoint_interval=100).fit(pack(chain_samples(20), 90))
    written = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").unlink()
    trainer = _trainer(tmp_path, steps=4, checkpoint_interval=100, resume="auto")
    trainer.resume()
    assert trainer.fit(pack(chain_samples(20), 90)).steps_run == 0
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again["steps_this_run"] == 0 and again["step"] == 4
    for key in ("loss", "tau", "slot_acceptance", "checkpoint"):
        assert again[key] == written[key], key


def test_a_refused_rerun_leaves_the_run_records_as_they_were(tmp_path):
    _trainer(tmp_path, steps=4, checkpoint_interval=100).fit(pack(chain_samples(20), 90))
    records = {name: (tmp_path / name).read_text() for name in ("config.yaml", "run.json")}
    other = Trainer(model_config=tiny_model_config(num_hidden_layers=1),
                    train=train_config(steps=4, checkpoint_interval=100, resume="auto"),
                    embeddings=target_embeddings(), run_dir=tmp_path, recipe_yaml="name: other\n")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        other.resume()
    assert {name: (tmp_path / name).read_text() for name in records} == records


def test_a_resume_with_other_overrides_keeps_each_segments_records(tmp_path, monkeypatch):
    """run.json keeps what produced the earlier steps (command, start, recipe) after a resume
    with another recipe; config.yaml is the newest recipe, the earlier one kept beside it."""
    import sys

    monkeypatch.setattr(sys, "argv", ["draftforge", "train", "r.yaml"])
    _trainer(tmp_path, steps=2).fit(pack(chain_samples(20), 90))
    [first] = json.loads((tmp_path / "run.json").read_text())["segments"]
    monkeypatch.setattr(sys, "argv", ["draftforge", "train", "r.yaml", "train.steps=4"])
    resumed = Trainer(model_config=tiny_model_config(), train=train_config(steps=4, resume="auto"),
                      embeddings=target_embeddings(), run_dir=tmp_path,
                      recipe_yaml="name: test\nsteps: 4\n")
    assert resumed.resume().step == 2
    resumed.fit(pack(chain_samples(20), 90))
    segments = json.loads((tmp_path / "run.json").read_text())["segments"]
    assert segments[0] == {**first, "config": "config.1.yaml"}
    assert segments[1]["command"][1:] == ["draftforge", "train", "r.yaml", "train.steps=4"]
    assert segments[1]["config"] == "config.yaml" and len(segments) == 2
    assert (tmp_path / "config.1.yaml").read_text() == "name: test\n"
    assert (tmp_path / "config.yaml").read_text() == "name: test\nsteps: 4\n"


def test_a_skipped_step_leaves_the_weights_untouched(tmp_path):
    samples = chain_samples(10, nan_ids=tuple(range(10)))
    trainer = _trainer(tmp_path, steps=3, max_bad_steps=5)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = trainer.fit(pack(samples, 90))
    assert result.skipped_steps == result.steps_run > 0
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(before[name], value), name
    assert all(math.isnan(loss) for loss in result.losses)


def test_missing_wandb_or_tensorboard_gives_install_advice(tmp_path, monkeypatch):
    import sys

    for module, key in (("wandb", "wandb"), ("torch.utils.tensorboard", "tensorboard")):
        monkeypatch.setitem(sys.modules, module, None)
        trainer = _trainer(tmp_path / key, steps=1, **{key: True})
        with pytest.raises(RuntimeError, match="pip install"):
            trainer.fit(pack(chain_samples(4), 90))


def test_parallel_strategies_need_torch_distributed(tmp_path):
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        _trainer(tmp_path, strategy="fsdp2")


def test_wandb_offline_and_tensorboard_receive_every_step(tmp_path, monkeypatch):
    import sys
    import types

    calls = {"init": [], "log": [], "scalars": [], "closed": 0}
    fake_wandb = types.ModuleType("wandb")

    class _Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["closed"] += 1

    def init(**kwargs):
        calls["init"].append(kwargs)
        return _Run()

    fake_wandb.init = init
    fake_tb = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            calls["log_dir"] = log_dir
            calls.setdefault("purge_step", []).append(purge_step)

        def add_scalar(self, tag, value, step):
            calls["scalars"].append((tag, step))

        def close(self):
            calls["closed"] += 1

    fake_tb.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    trainer = _trainer(tmp_path, steps=3, wandb=True, tensorboard=True)
    trainer.fit(pack(chain_samples(20), 90))
    assert calls["init"][0]["mode"] == "offline" and calls["init"][0]["config"] == {"name": "test"}
    assert [step for step, _ in calls["log"]] == [1, 2, 3]
    assert {"loss", "tau", "tokens_s", "wait_s"} <= set(calls["log"][0][1])
    assert ("train/loss", 3) in calls["scalars"] and calls["log_dir"].endswith("tensorboard")
    assert calls["closed"] == 2
    assert calls["purge_step"] == [None], "a fresh run purges nothing"
    from draftforge.train.metrics import MetricsLog

    resumed = MetricsLog(tmp_path, train=train_config(tensorboard=True), recipe_yaml=None, resume_step=2)
    resumed.close()
    assert calls["purge_step"] == [None, 3], "a run resumed at step 2 drops the events of steps 3 on"



def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """The resumed segment passes wandb the first segment's run id (resume="allow"), so wandb
    continues that run instead of opening a second one of the same name."""
    import sys
    import types

    inits = []
    fake_wandb = types.ModuleType("wandb")

    class _Run:
        def log(self, data, step):
            pass

        def finish(self):
            pass

    def init(*, dir, mode, config, name, id=None, resume=None, reinit=None):  # wandb.init's keywords
        inits.append({"dir": dir, "name": name, "id": id, "resume": resume})
        return _Run()

    fake_wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    _trainer(tmp_path / "run", steps=2, wandb=True).fit(pack(chain_samples(20), 90))
    first_id = inits[0]["id"]
    assert first_id and (tmp_path / "run" / "wandb_id.txt").read_text().strip() == first_id
    resumed = _trainer(tmp_path / "run", steps=4, wandb=True, resume="auto")
    assert resumed.resume().step == 2
    resumed.fit(pack(chain_samples(20), 90))
    assert inits[1] == {**inits[0], "resume": "allow"} and inits[1]["id"] == first_id
    _trainer(tmp_path / "other", steps=1, wandb=True).fit(pack(chain_samples(20), 90))
    assert inits[2]["id"] not in (None, first_id)  # another run directory, another wandb run

DEEPSPEED_INF_GRAD = """
import os, sys
from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
from trainer_helpers import chain_samples, target_embeddings, tiny_model_config, train_config
from draftforge.train.sample import pack
from draftforge.train.trainer import Trainer
run = Path(sys.argv[1])
trainer = Trainer(model_config=tiny_model_config(), train=train_config(output_dir=str(run), strategy="deepspeed",
                  zero_stage=2, steps=4, max_bad_steps=0), embeddings=target_embeddings(), run_dir=run,
                  recipe_yaml="name: t\\n", group=dist.group.WORLD)
param = next(p for p in trainer.model.parameters() if p.requires_grad)
param.register_hook(lambda g: g * float("inf") if trainer.step == 1 else g)  # step 2: loss finite, gradient not
result = trainer.fit(pack(chain_samples(40), 90))
print("RESULT", result.stopped_reason, result.skipped_steps, result.step,
      all(torch.isfinite(p).all().item() for p in trainer.model.parameters()))
dist.destroy_process_group()
from trainer_helpers import leave_at_once
leave_at_once()
"""


def test_deepspeed_counts_a_step_whose_gradient_is_not_finite_as_skipped(tmp_path):
    """DeepSpeed drops such an update itself and reports an infinite norm; the trainer must
    count the step as skipped (here max_bad_steps=0 stops the run at it), as the other
    strategies do, not log it as applied."""
    pytest.importorskip("deepspeed")
    from splitserve_helpers import run_script_rank

    stdout = run_script_rank(DEEPSPEED_INF_GRAD, tmp_path, "ds_inf.py")
    assert "RESULT max_bad_steps 1 2 True" in stdout, stdout[-2000:]

