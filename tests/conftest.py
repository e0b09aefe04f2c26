"""Shared pytest setup: offline libraries and a bounded number of torch threads."""

import os

# Nothing in the suite may reach a model hub or a tracking server.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402  (after the environment above)

# Deterministic, small thread counts: tests that start several processes
# must not oversubscribe the cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


# --------------------------------------------------------------------------- signal hygiene

import signal  # noqa: E402

import pytest  # noqa: E402

_WATCHED = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    """Each test leaves SIGINT and SIGTERM as it found them in the worker process: handled the
    same way and not blocked. An ignored or blocked SIGINT is inherited by every child a later
    test starts (across exec), and a Ctrl-C test run after the leak would find its child deaf
    to SIGINT. The test that changes them errors here, by name, and they are put back. (What
    made test_launch_r11's interrupted rank sleep through its SIGINT was not such a leak but the
    suite started in the background, whose shell hands it SIGINT ignored: that test now sets
    its child's handler itself.)"""
    before = {signum: signal.getsignal(signum) for signum in _WATCHED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = {signum: signal.getsignal(signum) for signum in _WATCHED}
    now_blocked = signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    changed = [f"{signal.Signals(s).name} handler {before[s]!r} -> {after[s]!r}"
               for s in _WATCHED if after[s] is not before[s]]
    changed += [f"{signal.Signals(s).name} left blocked" for s in set(now_blocked) - set(mask)
                if s in _WATCHED]
    for signum, handler in before.items():
        if handler is not None:
            signal.signal(signum, handler)
    if changed:
        pytest.fail("this test left the worker's signals changed: " + "; ".join(changed), pytrace=False)
