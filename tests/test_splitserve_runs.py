"""Whole SplitServe jobs on a tiny random target (gloo, CPU): train, stream, die, resume."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from splitserve_helpers import (
    PYTHON,
    ROOT,
    free_port,
    metrics,
    rank_env,
    read_logs,
    spawn_ranks,
    tiny_recipe,
    wait_all,
)

pytestmark = pytest.mark.distributed


def _by_step(records: list[dict]) -> dict[int, dict]:
    """The last record of every step (a resumed run logs the steps after its checkpoint again)."""
    out = {}
    for record in records:
        if "step" in record and "loss" in record:
            out[record["step"]] = record
    return out


def _mean(values):
    values = list(values)
    return sum(values) / len(values)


def _check_learns(run_dir: Path, steps: int) -> dict[int, dict]:
    records = _by_step(metrics(run_dir))
    assert sorted(records) == list(range(1, steps + 1))
    losses = [records[s]["loss"] for s in range(1, steps + 1)]
    assert _mean(losses[-3:]) < 0.9 * _mean(losses[:3]), losses
    return records


def test_two_process_run_trains_and_accounts(tmp_path):
    steps = 16
    # 24 conversations (3-5 a step) run out before step 16: the run reaches a second epoch.
    recipe = tiny_recipe(tmp_path, steps=steps, num_conversations=24)
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0], read_logs(tmp_path / "logs", 2)
    records = _check_learns(tmp_path / "run", steps)
    ids = [i for s in range(1, steps + 1) for i in records[s]["sample_ids"]]
    assert len(ids) == len(set(ids)), "sample ids are unique (later epochs carry #e<n>)"
    conversations = {json.loads(line)["id"] for line in (tmp_path / "convs.jsonl").open()}
    assert {i.split("#e")[0] for i in ids} <= conversations
    later = [n for n, i in enumerate(ids) if "#e" in i]
    assert later, "the run reaches a second epoch"
    # epoch 0 is complete before epoch 1 starts
    assert max(n for n, i in enumerate(ids) if "#e" not in i) < min(later)
    assert {i for i in ids if "#e" not in i} == conversations
    target_log, trainer_log = read_logs(tmp_path / "logs", 2)
    assert "split (last interval): target busy" in trainer_log and "recommended split for 2 ranks" in trainer_log
    assert "at most 4 samples in flight per trainer (credits 4)" in target_log
    accounting = [json.loads(line) for line in (tmp_path / "run" / "accounting.jsonl").open()]
    assert accounting[-1]["event"] == "summary"
    assert accounting[-1]["queue"]["max"] <= 4
    for record in accounting:
        for side in ("producer", "consumer"):
            assert 0.0 <= record[side]["busy_share"] + record[side]["idle_share"] <= 1.0 + 1e-6


def test_three_process_run_two_trainers(tmp_path):
    steps = 10
    recipe = tiny_recipe(tmp_path, trainers=2, steps=steps, num_conversations=64)
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    records = _check_learns(tmp_path / "run", steps)
    ids = [i for s in range(1, steps + 1) for i in records[s]["sample_ids"]]
    assert len(ids) == len(set(ids))
    # both trainers trained, on disjoint samples (the checkpoint's per-rank data cursor)
    state = json.loads((tmp_path / "run" / "checkpoints" / f"step_{steps:08d}" /
                        "trainer_state.json").read_text())
    first, second = state["consumed_ids"]
    assert first and second and not set(first) & set(second)
    assert sorted(first + second) == sorted(ids)


def test_two_targets_feed_one_trainer_and_the_queue_bound_is_the_whole_queues(tmp_path):
    """Two producers, one trainer, max_in_flight 4: 2 credits a link, and the trainer's
    queue (both links) never holds more than the 4 its accounting reports as the bound."""
    steps = 6
    recipe = tiny_recipe(tmp_path, steps=steps, num_conversations=64, overrides={
        "split.target_ranks": [0, 1], "split.trainer_ranks": [2], "train.strategy": "single"})
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    records = _by_step(metrics(tmp_path / "run"))
    assert sorted(records) == list(range(1, steps + 1))
    summary = [json.loads(line) for line in (tmp_path / "run" / "accounting.jsonl").open()][-1]
    assert summary["event"] == "summary" and summary["queue"]["credits"] == 4
    assert 0 < summary["queue"]["max"] <= 4
    for log in read_logs(tmp_path / "logs", 3)[:2]:
        assert "at most 2 samples in flight per trainer (credits 2)" in log


def test_a_full_link_does_not_stall_the_other_trainer(tmp_path):
    """One target feeding two trainers answers of varied length: a trainer that holds a
    step's data fills its link and waits in a collective while the other needs samples
    further on in the order. The producer used to wait on the full link, and both
    trainers stalled (here at step 4) until the peer timeout; each link now waits only
    for its own credits."""
    import random

    steps = 10
    recipe = tiny_recipe(tmp_path, trainers=2, num_conversations=400, overrides={
        "data.max_length": 512, "split.token_budget": 1024, "target.generation.batch_size": 8,
        "split.peer_timeout_s": 20, "train.steps": steps, "train.num_anchors": 2,
        "train.checkpoint_interval": 100, "train.log_interval": 1})
    rng, words = random.Random(1), "alpha beta gamma delta river stone cloud paper green seven".split()
    with (tmp_path / "convs.jsonl").open("w") as out:
        for i in range(400):
            length = min(600, int(rng.lognormvariate(3.5, 0.9)) + 3)
            answer = " ".join(rng.choice(words) for _ in range(length))
            out.write(json.dumps({"id": f"c{i:04d}", "messages": [
                {"role": "user", "content": "go"}, {"role": "assistant", "content": answer}]}) + "\n")
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 120) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    assert sorted(_by_step(metrics(tmp_path / "run"))) == list(range(1, steps + 1))


def test_uneven_trainers_finish_finite_data_without_waiting_on_each_other(tmp_path):
    """split.max_epochs=1, one target, two trainers: 15 short answers (two a micro-batch) and
    a long one (alone in its micro-batch), so the micro-batch balance gives one trainer 8 short
    samples (4 micro-batches) and the other 7 and the long one (5): the first fills the fifth
    step with a micro-batch that supervises nothing, and every sample trains. The producer used
    to send END only once every
    link's samples were out, in rank order: the trainer out of samples waited for its END to
    train its last step, the other, its link full, waited for it in a collective, and the
    producer waited for that full link's credit, until the peer timeout failed the job."""
    from draftforge.splitserve.producer import epoch_order

    recipe = tiny_recipe(tmp_path, trainers=2, steps=1000, num_conversations=16, overrides={
        "split.max_epochs": 1, "split.max_in_flight": 1, "split.peer_timeout_s": 20,
        "split.token_budget": 96, "train.checkpoint_interval": 1000, "train.log_interval": 1})
    # the fifth answer in stream order is the long one
    lengths = {index: 50 if position == 4 else 6 for position, index in enumerate(epoch_order(16, seed=0, epoch=0))}
    with (tmp_path / "convs.jsonl").open("w") as out:
        for i in range(16):
            answer = " ".join(["river"] * lengths[i])
            out.write(json.dumps({"id": f"c{i}", "messages": [
                {"role": "user", "content": "go"}, {"role": "assistant", "content": answer}]}) + "\n")
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    final = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    first, second = json.loads((final / "trainer_state.json").read_text())["consumed_ids"]
    assert not set(first) & set(second) and set(first + second) <= {f"c{i}" for i in range(16)}
    # the trainer given 4 micro-batches trained them all (8 samples, its last one closed by
    # END); the other trained its fifth micro-batch too, the first filling that step
    assert sorted((len(first), len(second))) == [8, 8]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["step"], summary["stopped_reason"], summary["untrained_at_end"]) == (5, "data_exhausted", 0)
    # what waited on the target for one trainer beyond its link: at most a chunk of 4 samples
    # of at most data.max_length (96) tokens beside what the balance keeps back
    waiting = re.search(r"and (\d+) tokens waiting here for one trainer", read_logs(tmp_path / "logs", 3)[0])
    assert waiting and 0 < int(waiting.group(1)) <= 2 * 4 * 96, read_logs(tmp_path / "logs", 3)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_three_process_run_deepspeed(tmp_path, stage):
    """The same stream feeds a DeepSpeed ZeRO-2 or ZeRO-3 trainer group beside the target rank
    (ZeRO-3 used to be refused there: DeepSpeed ran its collectives on the whole world)."""
    pytest.importorskip("deepspeed")
    steps = 8
    recipe = tiny_recipe(tmp_path, trainers=2, steps=steps, num_conversations=64,
                         overrides={"train.strategy": "deepspeed", "train.zero_stage": stage,
                                    "split.peer_timeout_s": 15})
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    assert wait_all(procs, 150) == [0, 0, 0], read_logs(tmp_path / "logs", 3)
    _check_learns(tmp_path / "run", steps)


def test_regenerating_run(tmp_path):
    """data.regenerate: the target answers the prompts itself, on the fly."""
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"data.regenerate": True,
                                                       "data.min_loss_tokens": 2})
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0], read_logs(tmp_path / "logs", 2)
    records = _by_step(metrics(tmp_path / "run"))
    assert sorted(records) == [1, 2, 3, 4]


def _wait_for_a_checkpoint(run_dir: Path, procs, timeout: float) -> None:
    """Until ``run_dir`` holds a complete checkpoint, whichever. Waiting for one step's folder
    raced the pruning: at 27 steps a second, with a checkpoint every 2 steps and the last 3
    kept, step 2's folder lived a quarter of a second, and a poll on a loaded machine missed
    it while the job ran on to its end (seen in a full run of the suite)."""
    from draftforge.train.checkpoint import complete_checkpoints

    deadline = time.monotonic() + timeout
    while not complete_checkpoints(run_dir):
        assert time.monotonic() < deadline, f"no checkpoint appeared in {run_dir}"
        assert all(p.poll() is None for p in procs), "a rank ended before the checkpoint"
        time.sleep(0.02)


@pytest.mark.parametrize("reuse", [False, True])
def test_dead_target_stops_trainer_and_resume_is_exact(tmp_path, reuse):
    """With split.reuse_features the resumed target computes again the epoch-1 features it had
    kept from epoch-0 batches before the kill (tests/test_reuse_r54.py compares them bit for bit)."""
    steps = 24
    # two chunks of credits, as reuse_features needs (tests/test_reuse_r54.py)
    overrides = {"split.reuse_features": True, "split.max_in_flight": 8} if reuse else None
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    recipe = tiny_recipe(reference_dir, steps=steps, overrides=overrides)
    procs = spawn_ranks(recipe, 2, log_dir=reference_dir / "logs")
    assert wait_all(procs, 90) == [0, 0], read_logs(reference_dir / "logs", 2)
    reference = _by_step(metrics(reference_dir / "run"))
    ids = [i for step in sorted(reference) for i in reference[step]["sample_ids"]]
    first_e1 = next(n for n, i in enumerate(ids) if i.endswith("#e1"))
    # epoch 1 starts after epoch 0's last sample, or, reusing features, one chunk after its first
    assert (first_e1 < max(n for n, i in enumerate(ids) if "#e" not in i)) == reuse, ids

    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    recipe = tiny_recipe(broken_dir, steps=steps, overrides=overrides)
    procs = spawn_ranks(recipe, 2, log_dir=broken_dir / "logs")
    _wait_for_a_checkpoint(broken_dir / "run", procs, 60)
    procs[0].send_signal(signal.SIGKILL)  # the target rank dies mid-run
    killed_at = time.monotonic()
    codes = wait_all(procs[1:], 60)
    assert time.monotonic() - killed_at < 30
    assert codes == [3]
    trainer_log = read_logs(broken_dir / "logs", 2)[1]
    assert "target rank 0 died or closed its connection" in trainer_log
    assert "rerun the same command" in trainer_log
    procs[0].wait()
    with (broken_dir / "run" / "accounting.jsonl").open("a") as handle:
        handle.write('{"event": "interval", "st')  # a line the crash cut short

    procs = spawn_ranks(recipe, 2, log_dir=broken_dir / "logs2")
    assert wait_all(procs, 90) == [0, 0], read_logs(broken_dir / "logs2", 2)
    resumed_log = read_logs(broken_dir / "logs2", 2)[1]
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", resumed_log).group(1))
    # every line parses; each run's segment starts with a start record at its first step
    accounting = [json.loads(line) for line in (broken_dir / "run" / "accounting.jsonl").open()]
    starts = [(r["event"], r["step"]) for r in accounting if r["event"] == "start"]
    assert starts == [("start", 0), ("start", resumed_at)] and resumed_at >= 4
    assert accounting[-1]["event"] == "summary"
    resumed = _by_step(metrics(broken_dir / "run"))
    assert sorted(resumed) == sorted(reference) == list(range(1, steps + 1))
    for step in reference:
        assert resumed[step]["sample_ids"] == reference[step]["sample_ids"], step
        assert resumed[step]["loss"] == reference[step]["loss"], step


def test_silent_target_times_out_with_its_rank(tmp_path):
    """A target that hangs (SIGSTOP) is reported after split.peer_timeout_s, not waited on forever."""
    # steps enough that the job cannot end before it is stopped (it is, at its first checkpoint)
    recipe = tiny_recipe(tmp_path, steps=2000, overrides={"split.peer_timeout_s": 6})
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    try:
        _wait_for_a_checkpoint(tmp_path / "run", procs, 60)
        procs[0].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert wait_all(procs[1:], 60) == [3]
        assert time.monotonic() - stopped_at < 40
        log = read_logs(tmp_path / "logs", 2)[1]
        assert "target rank 0 sent nothing within the timeout" in log, log[-2000:]
    finally:
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()


def test_draftforge_train_command_end_to_end(tmp_path):
    """``draftforge train`` starts torchrun, which starts both ranks."""
    recipe = tiny_recipe(tmp_path, steps=6)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [PYTHON, "-m", "draftforge", "train", str(recipe)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"draftforge train: 2 ranks of {shlex.quote(PYTHON)} -m draftforge.train" in done.stderr
    assert "(rendezvous on 127.0.0.1)" in done.stderr
    assert sorted(_by_step(metrics(tmp_path / "run"))) == list(range(1, 7))
    assert (tmp_path / "run" / "checkpoints" / "step_00000006").is_dir()
    # run.json keeps the user's own command beside the rank's (whose launcher options it lacks)
    segment = json.loads((tmp_path / "run" / "run.json").read_text())["segments"][0]
    assert segment["launched_by"][0] == PYTHON and segment["launched_by"][2:] == ["train", str(recipe)]
    assert segment["command"][2:] == [str(recipe)] and segment["cwd"] == str(ROOT)


def train_to_a_checkpoint(tmp_path: Path) -> subprocess.Popen:
    """``draftforge train`` of a tiny recipe in a session of its own, output piped, once its
    run holds a checkpoint; steps enough that it cannot end before the test signals it."""
    recipe = tiny_recipe(tmp_path, steps=4000, overrides={"train.checkpoint_interval": 2})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([PYTHON, "-m", "draftforge", "train", str(recipe)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        _wait_for_a_checkpoint(tmp_path / "run", [proc], 120)
    except AssertionError as exc:
        proc.kill()
        raise AssertionError(f"{exc}\n{proc.communicate()[0][-3000:]}") from None
    return proc


def test_ctrl_c_stops_the_job_with_one_message_and_no_rank_tracebacks(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: every rank used to print a
    KeyboardInterrupt traceback. Each now says 'interrupted'; the launcher exits 130 and
    says how to continue."""
    proc = train_to_a_checkpoint(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "interrupted" in out and "stopped on SIGINT; rerun the same command to continue" in out


def test_bigram_markov_init_at_the_start_and_not_on_resume(tmp_path):
    recipe = tiny_recipe(tmp_path, steps=4, overrides={"train.markov_init": "bigram"})
    procs = spawn_ranks(recipe, 2, log_dir=tmp_path / "logs")
    assert wait_all(procs, 90) == [0, 0], read_logs(tmp_path / "logs", 2)
    trainer_log = read_logs(tmp_path / "logs", 2)[1]
    assert "markov head initialised as a rank-8 bigram of the training answers" in trainer_log
    # continuing the run loads the checkpoint's weights: no second initialisation
    procs = spawn_ranks(recipe, 2, "train.steps=6", log_dir=tmp_path / "logs2")
    assert wait_all(procs, 90) == [0, 0], read_logs(tmp_path / "logs2", 2)
    resumed = read_logs(tmp_path / "logs2", 2)[1]
    assert "resum" in resumed.lower() and "markov head initialised" not in resumed
    assert sorted(_by_step(metrics(tmp_path / "run"))) == list(range(1, 7))


def test_a_trainer_that_dies_stops_the_other_trainer_with_a_message(tmp_path):
    """A trainer killed mid-run breaks the trainer group's collectives: the surviving trainer
    stops with the peer-death status and the resume hint, not a gloo traceback (exit 1)."""
    recipe = tiny_recipe(tmp_path, trainers=2, steps=2000)
    procs = spawn_ranks(recipe, 3, log_dir=tmp_path / "logs")
    try:
        _wait_for_a_checkpoint(tmp_path / "run", procs, 90)
        procs[2].send_signal(signal.SIGKILL)
        assert wait_all(procs[1:2], 60) == [3]
        log = read_logs(tmp_path / "logs", 3)[1]
        # which it meets first is a race: the collective with the dead trainer, or the target
        # that stopped on seeing that trainer gone
        assert re.search(r"stopping: (a trainer rank died or closed its connection.*in a collective "
                         r"of the trainer group|target rank 0 died or closed its connection)", log), log[-2000:]
        assert "rerun the same command" in log and "Traceback" not in log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


WAITING_FOR_ITS_TURN = """
import datetime, json, sys, time
import torch, torch.distributed as dist
from draftforge.splitserve import transport as T
from draftforge.splitserve.accounting import Meter
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
acks = dist.new_group([0, 1, 2], backend="gloo")
if rank < 2:  # two producers feed trainer 2 in turn; rank 0 takes 1 s a sample, rank 1 nothing
    gate, meter = T.CreditGate([2], 2, group=acks, timeout_s=60), Meter()
    meter.start()
    for n in range(4):
        if rank == 0:
            with meter.busy("features"):
                time.sleep(1.0)
        with meter.idle("credits"):
            gate.acquire([2])
        T.send_sample(2, f"s{rank}-{n}", torch.arange(8), torch.ones(8, dtype=torch.bool),
                      torch.zeros(8, 4), torch.zeros(8, 4), seq_no=n, meter=meter)
        gate.note_sent(2)
    T.send_end(2)
    gate.wait_all_stopped(60)
    meter.stop()
    print(json.dumps(meter.summary()), flush=True)
else:
    from draftforge.splitserve.consumer import ConsumerStream
    stream = ConsumerStream(T.SampleReceiver([0, 1], credits=2), ack_group=acks)
    print(json.dumps([s.sample_id for s in stream.samples()]), flush=True)
    stream.stop(timeout_s=60)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_producer_waiting_for_its_turn_in_the_rotation_is_idle_not_busy(tmp_path):
    """A gloo send waits for the matching receive; a trainer fed by two producers posts it for
    one at a time. The fast producer's wait for its turn was booked as busy 'send' (busy 100 %,
    capacity far too low, the slower side and the recommended split wrong)."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, "-c", WAITING_FOR_ITS_TURN], env=rank_env(rank, 3, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for rank in range(3)]  # fmt: skip
    outs = [proc.communicate(timeout=90)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outs
    slow, fast = (json.loads(out.strip().splitlines()[-1]) for out in outs[:2])
    assert json.loads(outs[2].strip().splitlines()[-1])[:4] == ["s0-0", "s1-0", "s0-1", "s1-1"]
    assert fast["idle_share"] > 0.8 and fast["busy_by_part_s"].get("send", 0.0) < 0.5, fast
    assert slow["busy_share"] > 0.8 and slow["busy_by_part_s"]["features"] > 3.5, slow
