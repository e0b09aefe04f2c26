"""Fakes of the regeneration tests (``tests/test_data_regenerate.py``).

They live in a module of their own, importable by its plain name from ``tests/`` (on
pytest's ``pythonpath``), because ``data.answer_workers`` spawns processes that unpickle
the engine builders by module name: a test module is not importable that way under
``--import-mode=importlib``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time

from draftforge.data.formats import Conversation
from draftforge.splitserve.config import GenerationConfig


class Interrupted(Exception):
    pass


class FakeEngine:
    name = "fake-target"

    def __init__(self, fail_on_call: int | None = None):
        self.calls: list[tuple[list[list[dict[str, str]]], int]] = []
        self.fail_on_call = fail_on_call

    def generate(self, conversations, settings):
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            raise Interrupted
        self.calls.append(([list(c) for c in conversations], settings.seed))
        replies = []
        for conv in conversations:
            assert conv[-1]["role"] == "user"
            key = json.dumps(conv) + f"|{settings.seed}|{settings.temperature}"
            replies.append("reply " + hashlib.sha256(key.encode()).hexdigest()[:10])
        return replies


def make_prompts(n: int = 11) -> list[Conversation]:
    prompts = []
    for i in range(n):
        msgs = []
        if i % 4 == 0:
            msgs.append({"role": "system", "content": f"system {i}"})
        msgs.append({"role": "user", "content": f"question {i}"})
        if i % 3 == 0:
            msgs.append({"role": "user", "content": f"follow-up {i}"})
        prompts.append(Conversation(f"p{i:02d}", msgs))
    return prompts


SETTINGS = GenerationConfig(batch_size=3, temperature=0.7, seed=5)





def build_fake_engine():
    return FakeEngine()


class FailingOnBatch(FakeEngine):
    def generate(self, conversations, settings):
        if any(c[-1]["content"] == "question 7" for c in conversations):
            raise RuntimeError("no answer for question 7")
        return super().generate(conversations, settings)


def build_failing_engine():
    return FailingOnBatch()


def build_broken_engine():
    raise ValueError("weights not found at /nowhere")


class DyingOnBatch(FakeEngine):
    def generate(self, conversations, settings):
        if any(c[-1]["content"] == "question 7" for c in conversations):
            os._exit(9)
        return super().generate(conversations, settings)


def build_dying_engine():
    return DyingOnBatch()



def build_engine_named_for_its_bars():
    from transformers.utils import logging as hf_logging

    engine = FakeEngine()
    engine.name = "bars-on" if hf_logging.is_progress_bar_enabled() else "bars-off"
    return engine


class SlowEngine(FakeEngine):
    def generate(self, conversations, settings):
        time.sleep(0.5)
        return super().generate(conversations, settings)


WORKER_LOCKS = []


def build_slow_engine():
    # a named semaphore, as tqdm's progress bars make in a real worker: it is reported
    # leaked unless the worker's exit handlers run when it is stopped
    WORKER_LOCKS.append(multiprocessing.get_context("spawn").Lock())
    return SlowEngine()
