"""Round 37, own target: problems found running draftforge against local Qwen3 / Llama folders."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A regeneration worker that has finished (here: its target could not be built, as for a
# folder without a tokenizer) is stopped by the parent with SIGTERM while it may already be
# exiting. Landing in the interpreter's shutdown (threading._shutdown, waiting for a thread),
# the SystemExit of its SIGTERM handler used to be printed as "Exception ignored in: <module
# 'threading'> ... Traceback ... SystemExit: 143" under the run's clear error message.
_FINISHED_WORKER = textwrap.dedent(
    """
    import os, signal, threading, time
    from multiprocessing import Pipe
    from draftforge.data.answer_workers import _work
    from draftforge.errors import InputError

    def build():
        raise InputError("target folder /x has no tokenizer")

    parent_end, child_end = Pipe()
    _work(build, None, child_end, True, os.getppid())
    assert parent_end.recv()[0] == "refused"

    def parent_stops_us():  # the parent's terminate(), arriving while this process exits
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.3)

    threading.Thread(target=parent_stops_us).start()  # not daemon: the exit waits for it
    """
)


def test_finished_worker_stopped_while_exiting_prints_no_traceback():
    done = subprocess.run([sys.executable, "-c", _FINISHED_WORKER], capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


def test_eval_workloads_without_a_chat_template_say_how_to_give_one():
    """`draftforge eval EXPORT --target DIR` (no --recipe) on a base model's folder: the error
    said only "set target.generation.chat_template", a recipe key this command had no recipe
    for. It now names the folder and the two ways out: a recipe (--recipe) or token ids."""
    import pytest

    from draftforge.errors import InputError
    from draftforge.eval.cli import _workload_prompts
    from draftforge.splitserve.config import TargetConfig

    class NoTemplate:
        chat_template = None

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")

    class Target:
        tokenizer = NoTemplate()

    with pytest.raises(InputError) as refused:
        _workload_prompts("gsm8k", Target(), TargetConfig(model="/models/base-llama"), 1)
    message = str(refused.value)
    assert "/models/base-llama" in message
    assert "--recipe" in message and "target.generation.chat_template" in message
    assert "--prompts-file" in message


def test_the_model_card_says_what_an_export_with_embeddings_carries(tmp_path):
    """The card said only "It needs the target's embedding and lm_head at serving time" of an
    export that holds copies of both (--with-embeddings)."""
    from test_llamacpp import _smollm2_shaped_draft

    from draftforge.train.export import export_draft

    draft = _smollm2_shaped_draft(num_hidden_layers=1)
    sentence = "It needs the target's embedding and lm_head at serving time (servers attach them)"
    with_copies = export_draft(draft, tmp_path / "with", with_embeddings=True, progress=lambda _: None)
    card = (with_copies / "README.md").read_text()
    assert (sentence + "; this folder also carries copies of them (exported with --with-embeddings), "
            "which SGLang ignores.") in card
    without = export_draft(draft, tmp_path / "without", progress=lambda _: None)
    assert sentence + "." in (without / "README.md").read_text()
