"""SplitServe stream, round 6: data problems a target rank meets are input errors (exit
status 2, never restarted), and a target rank names the trainer that went silent while it
waited for the trainers' stops."""

from __future__ import annotations

import threading
import time
import types

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import load_recipe
from draftforge.errors import InputError
from draftforge.splitserve import transport as T
from draftforge.splitserve.producer import SampleSource, Topology, load_source_conversations
from draftforge.splitserve.target import load_tokenizer


def _source(tmp_path, topology: Topology, producer: int, *, num_conversations: int = 8,
            overrides: dict | None = None) -> SampleSource:
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=num_conversations, overrides=overrides))
    conversations, regenerate = load_source_conversations(cfg)
    engine = types.SimpleNamespace(tokenizer=load_tokenizer(cfg.target))
    return SampleSource(cfg, engine, topology, producer, conversations=conversations,
                        regenerate=regenerate)


def test_a_target_rank_without_a_share_of_the_data_refuses_its_input(tmp_path):
    """Two conversations for three target ranks: the third has nothing to serve. That is the
    data's fault, so an InputError (exit status 2, which the launcher does not restart), not
    a ValueError (a traceback, exit status 1, and split.restart_target restarting the job
    to fail the same way)."""
    topology = Topology(producers=(0, 1, 2), trainers=(3,))
    with pytest.raises(InputError, match=r"target rank 2 has no conversations to serve: 2 conversations"):
        next(_source(tmp_path, topology, 2, num_conversations=2).samples())


def test_an_epoch_without_a_trainable_sample_is_an_input_error(tmp_path):
    """Every answer is shorter than data.min_loss_tokens: the message names the setting."""
    topology = Topology(producers=(0,), trainers=(1,))
    source = _source(tmp_path, topology, 0, overrides={"data.min_loss_tokens": 90})
    with pytest.raises(InputError, match=r"epoch 0 produced no sample.*data.min_loss_tokens=90"):
        next(source.samples())
    assert source.dropped_short == 8  # every conversation was tokenised and dropped


def _listener(dests: list[int]) -> types.SimpleNamespace:
    """An AckListener's shared state without its threads."""
    now = time.monotonic()
    return types.SimpleNamespace(srcs=list(dests), consumed=dict.fromkeys(dests, 0), stopped=set(),
                                 heard=dict.fromkeys(dests, now), error=None,
                                 cond=threading.Condition())


def test_waiting_for_the_stops_names_the_trainer_that_went_silent():
    """Trainer 4 stopped, trainer 5 has sent nothing for longer than the timeout: the target
    rank names 5 (it said "a trainer rank" once it fed more than one)."""
    listener = _listener([3, 4, 5])
    listener.stopped.add(4)
    listener.heard[5] -= 30.0
    gate = T.CreditGate([3, 4, 5], 2, timeout_s=60, listener=listener)
    with pytest.raises(T.PeerDied, match=r"^trainer rank 5 sent nothing within the timeout") as caught:
        gate.wait_all_stopped(10.0)
    assert caught.value.rank == 5
    assert "trainer ranks [5]" in str(caught.value) and "for 10 s" in str(caught.value)


def test_waiting_for_the_stops_returns_once_every_trainer_has_stopped():
    listener = _listener([3, 4])
    gate = T.CreditGate([3, 4], 2, timeout_s=60, listener=listener)

    def stop_later():
        time.sleep(0.2)
        with listener.cond:
            listener.stopped.update({3, 4})
            listener.cond.notify_all()

    threading.Thread(target=stop_later, daemon=True).start()
    assert gate.wait_all_stopped(10.0) is True


def test_fewer_conversations_than_target_ranks_is_refused_before_any_rank_starts(tmp_path):
    """The launcher's preflight refuses it (before a target loads), and each target rank's
    share is exactly nonempty once there are as many conversations as target ranks."""
    from draftforge.data.formats import DataFormatError
    from draftforge.splitserve.launch import preflight

    split = {"split.target_ranks": [0, 1, 2], "split.trainer_ranks": [3]}
    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=2, overrides=split))
    with pytest.raises(DataFormatError, match=r"2 conversations for 3 target ranks"):
        preflight(cfg)
    for producers, trainers in (((0, 1, 2), (3,)), ((0, 1), (2, 3, 4)), ((0, 1, 2, 3, 4), (5, 6))):
        topology = Topology(producers=producers, trainers=trainers)
        owners = {topology.producer_of(n) for n in range(len(producers))}
        assert owners == set(producers), (producers, trainers)


def test_a_logger_turned_on_but_not_installed_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """train.wandb / train.tensorboard without the package: the launcher's preflight says what
    to install (exit status 2), instead of trainer rank 0 failing once the target has loaded."""
    import importlib.util

    from draftforge.errors import InputError
    from draftforge.splitserve.launch import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    cfg = load_recipe(tiny_recipe(tmp_path, overrides={"train.wandb": True, "train.tensorboard": True}))
    with pytest.raises(InputError) as caught:
        preflight(cfg)
    assert "train.wandb is true but wandb is not installed" in str(caught.value)
    assert "train.tensorboard is true but tensorboard is not installed" in str(caught.value)
    (tmp_path / "off").mkdir()
    preflight(load_recipe(tiny_recipe(tmp_path / "off")))  # both off: nothing to install


def test_an_epoch_whose_prompts_fill_max_length_says_to_raise_it(tmp_path):
    """data.max_length shorter than the prompts cuts every reply away: the message said only
    that the conversations had too few supervised tokens, not that the limit removed them."""
    topology = Topology(producers=(0,), trainers=(1,))
    source = _source(tmp_path, topology, 0, overrides={"data.max_length": 6, "data.min_loss_tokens": 1})
    with pytest.raises(InputError, match=r"epoch 0 produced no sample \(every conversation had fewer than "
                                         r"data.min_loss_tokens=\d+ supervised tokens; 8 were cut to "
                                         r"data.max_length=6 tokens, .*raise data.max_length\)"):
        next(source.samples())
