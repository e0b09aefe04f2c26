"""Review round 18 leftovers: malformed data in a trainer's drain, the rank entry's refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from splitserve_helpers import tiny_recipe
from test_stream_r14 import CLOSED, _loopback

from draftforge.splitserve import transport as T

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the end of a run


def _failed_receiver(sources: list[int]) -> T.SampleReceiver:
    """A receiver whose thread has met what the wire holds (and ended on it)."""
    receiver = T.SampleReceiver(sources, credits=2)
    deadline = time.monotonic() + 10
    while receiver.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return receiver


def test_malformed_data_in_the_drain_after_the_last_step_is_a_warning(monkeypatch):
    """Target rank 0, dying after the trainer's last step, put a malformed header on the wire
    (a sample of -1 positions). The receive thread kept its WireError, and stop() raised it:
    a finished run (steps done, checkpoint written) failed with a traceback before its
    accounting summary. Now the drain ends with a warning on the rank's log, as for a
    producer that died; mid-stream the same data still fails the run."""
    from draftforge.splitserve.consumer import ConsumerStream

    wire, headers = _loopback(monkeypatch)
    wire.append(T._header(T.SAMPLE, [-1, 2, 2, T.DTYPE_CODES[T.WIRE_DTYPE], 1, 7]))
    receiver = _failed_receiver([0])
    assert isinstance(receiver.error, T.WireError)
    lines: list[str] = []
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0], group=None, every_s=3600),
                            log=lines.append)
    assert stream.stop(timeout_s=5) == 0
    assert [(dst, kind, values[:2]) for dst, kind, values in headers] == [(0, T.ACK, [0, 1])]  # told to stop
    assert stream.warning.startswith(
        "warning: after this trainer's last step, rank 0 sent a malformed sample header [")
    assert stream.warning.endswith("; its steps are done, the stream's end not waited for")
    assert lines == [stream.warning]
    assert stream.stop() == 0 and lines == [stream.warning]  # once only
    # while the trainer still takes samples, malformed data is an error
    wire.clear()
    wire.append(T._header(T.SAMPLE, [-1, 2, 2, T.DTYPE_CODES[T.WIRE_DTYPE], 1, 7]))
    stream = ConsumerStream(_failed_receiver([0]), ack_group=None,
                            acks=T.AckLink([0], group=None, every_s=3600), log=lines.append)
    with pytest.raises(T.WireError, match="rank 0 sent a malformed sample header"):
        next(stream.samples())
    stream.acks.close()


def test_malformed_data_after_a_dead_producer_is_named_on_a_line_of_its_own(monkeypatch):
    """Rank 1 died (the stop ACK to it fails), then rank 0's stream held a message without
    the draftforge header: the first warning names the dead rank, the second the malformed
    data, and stop() returns."""
    from draftforge.splitserve.consumer import ConsumerStream

    wire, _ = _loopback(monkeypatch, dead={1})
    wire.append(T._header(T.SAMPLE).fill_(5))  # no MAGIC: not a draftforge message
    receiver = _failed_receiver([0, 1])
    assert isinstance(receiver.error, T.WireError)
    lines: list[str] = []
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0, 1], group=None, every_s=3600),
                            log=lines.append)
    assert stream.stop(timeout_s=5) == 0
    assert lines[0] == stream.warning == (
        f"warning: after this trainer's last step, target rank 1 died or closed its connection: {CLOSED} "
        "(while telling it to stop); its steps are done, the stream's end not waited for")
    assert lines[1].startswith("warning: after this trainer's last step, rank 0 sent a message "
                               "without the draftforge header (got 0x5)")
    assert lines[1].endswith("; that stream's end not waited for either") and len(lines) == 2


# --------------------------------------------------------------------------- the rank entry


def _rank(recipe: Path, tmp_path: Path, *overrides: str, **env: str) -> tuple[int, str, str]:
    """``python -m draftforge.train RECIPE`` as rank 1 of 2 (as torchrun starts it, its node's
    launcher asking for the input-error marker): status, stderr, the marker's text."""
    marker = tmp_path / "input-error"
    full = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "DRAFTFORGE_INPUT_ERROR_FILE": str(marker), **env}
    done = subprocess.run([sys.executable, "-m", "draftforge.train", str(recipe), *overrides],
                          env=full, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout == ""
    return done.returncode, done.stderr, marker.read_text() if marker.exists() else ""


def _line_of(recipe: Path, text: str) -> int:
    return recipe.read_text().splitlines().index(text) + 1


def test_a_bad_recipe_ends_a_rank_with_status_2_and_the_located_problem(tmp_path):
    """A recipe the rank refuses, at load (an unknown key) or at its start (a split of 2 ranks
    started as 3): status 2, the problem led by the recipe line that set the key, under
    "invalid recipe:", no traceback, and the marker that keeps the node's launcher from
    restarting it (the recipe would be refused again)."""
    recipe = tiny_recipe(tmp_path, overrides={"train.stepz": 3})
    code, err, marker = _rank(recipe, tmp_path)
    assert code == 2, err
    line = _line_of(recipe, "  stepz: 3")
    assert err.startswith(f"draftforge train: invalid recipe:\n{recipe}:{line}: train.stepz: unknown key "
                          "(did you mean 'steps'?); valid keys: "), err
    assert "Traceback" not in err and len(err.splitlines()) == 2
    assert marker.startswith(f"rank 1: {recipe}:{line}: train.stepz: unknown key")

    good = tmp_path / "good"
    good.mkdir()
    recipe = tiny_recipe(good)
    code, err, _ = _rank(recipe, good, WORLD_SIZE="3")
    assert code == 2, err
    assert err == (
        f"draftforge train: invalid recipe:\n{recipe}:{_line_of(recipe, 'split:')}: split.world_size: "
        "the recipe's split has 2 ranks (target [0], trainer [1]) but 3 processes were started; "
        "start 2 (torchrun --nproc_per_node=2) or change the split\n")
    # an override is located on the command line
    code, err, _ = _rank(recipe, good, "train.steps=0")
    assert (code, err) == (2, "draftforge train: invalid recipe:\ncommand line 'train.steps=0': "
                              "train.steps: must be greater than 0, got int 0\n")


def test_a_bad_setting_outside_the_recipe_is_an_error_not_an_invalid_recipe(tmp_path):
    """DRAFTFORGE_MALLOC holding neither 'tuned' nor 'default': status 2 and the setting, not
    "invalid recipe" (the recipe is fine)."""
    code, err, marker = _rank(tiny_recipe(tmp_path), tmp_path, DRAFTFORGE_MALLOC="bogus")
    assert (code, err) == (2, "draftforge train: error: DRAFTFORGE_MALLOC='bogus': expected 'tuned' "
                              "(the default) or 'default'\n")
    assert marker == "rank 1: DRAFTFORGE_MALLOC='bogus': expected 'tuned' (the default) or 'default'\n"


def test_after_malformed_data_the_other_producers_are_still_drained_to_their_end(monkeypatch):
    """Rank 0's stream held a message without the draftforge header, rank 1 still had a
    sample and its END in flight. The drain stopped at the malformed data, leaving rank 1
    waiting in its send (it reports the trainer dead once the trainer exits); WireError now
    names its rank, so the drain skips that stream alone and receives rank 1 to its END."""
    from draftforge.splitserve.consumer import ConsumerStream

    wire, headers = _loopback(monkeypatch)
    wire.append(T._header(T.SAMPLE).fill_(5))  # read as rank 0's: the rotation starts there
    T.send_sample(1, "s1", torch.arange(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, 2),
                  torch.zeros(4, 2), seq_no=0)
    T.send_end(1)
    receiver = _failed_receiver([0, 1])
    assert isinstance(receiver.error, T.WireError) and receiver.error.rank == 0
    lines: list[str] = []
    stream = ConsumerStream(receiver, ack_group=None, acks=T.AckLink([0, 1], group=None, every_s=3600),
                            log=lines.append)
    assert stream.stop(timeout_s=5) == 1  # rank 1's sample, dropped; then its END
    assert [kind for _, kind, _ in headers][-2:] == [T.ACK, T.ACK]  # both told to stop
    assert all(int(t[1]) == T.ACK for t in wire)  # nothing of rank 1's left unread
    assert len(lines) == 1 and "rank 0 sent a message without the draftforge header" in lines[0]
