"""Review round 7 of regeneration: the decoding loop on hybrid targets, workers that die idle."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from regenerate_helpers import SETTINGS, FakeEngine, Interrupted, build_fake_engine, make_prompts

from draftforge.data.regenerate import RegenerationError, regenerate
from draftforge.splitserve.config import GenerationConfig
from draftforge.splitserve.sampling import decode


def _hybrid_target():
    """Ling-3.0-Flash's architecture (bailing_hybrid) in small: linear-attention layers, whose
    cache keeps conv and recurrent states per row, and MLA layers."""
    cfg = transformers.BailingHybridConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=6,
        layer_group_size=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        num_local_experts=4, first_k_dense_replace=1, num_mtp_layers=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 3.0)  # no near-ties among the random logits
    return model


def test_a_hybrid_target_decodes_a_batch_whose_rows_end_at_different_steps():
    """A row that ended was dropped from the cache whenever the cache object had
    ``batch_select_indices``, which transformers' linear-attention layers lack: decoding a
    batch on a hybrid target (Ling-3.0-flash, Qwen3-Next with target.backend hf) stopped with
    an AttributeError at the first row to end. Each row must be what it decodes alone."""
    model = _hybrid_target()
    settings = GenerationConfig(temperature=0.0, max_new_tokens=12)
    prompts = [[5, 9, 3, 7, 2, 8, 4, 6, 11, 12], [13, 17, 19, 2], [3, 3, 4, 5, 6, 7, 8]]

    def alone(prompt, eos):
        ids = torch.tensor([prompt])
        out = decode(model, ids, torch.ones_like(ids), settings, eos_ids=eos, pad_id=0, generator=None)
        return out[0].tolist()

    eos = alone(prompts[1], [63])[2]  # the short prompt's third token ends its turn
    expected = [alone(p, [eos]) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    got = decode(model, ids, mask, settings, eos_ids=[eos], pad_id=0, generator=None).tolist()
    lengths = [len(row) for row in expected]
    assert min(lengths) < max(lengths) == settings.max_new_tokens  # one ends while others go on
    assert [row[: len(e)] for row, e in zip(got, expected, strict=True)] == expected
    assert all(set(row[len(e):]) <= {0} for row, e in zip(got, expected, strict=True))


def test_a_worker_killed_while_idle_is_reported_as_such():
    """A worker killed between two batches (the out-of-memory killer, while others load
    their targets) made handing it its next batch raise a bare BrokenPipeError, which the
    command printed as a traceback naming no worker."""
    from draftforge.data.answer_workers import WorkerError, WorkerPool

    prompts = make_prompts(12)
    batches = [(b, prompts[3 * b : 3 * b + 3]) for b in range(4)]
    answers = WorkerPool(build_fake_engine, 2, "fake-target").answer_batches(batches, SETTINGS)
    try:
        next(answers)  # a worker has answered a batch and waits for the next
        workers = [p for p in multiprocessing.active_children() if p.name.startswith("draftforge-answer-")]
        assert len(workers) == 2
        for process in workers:
            os.kill(process.pid, signal.SIGKILL)
            process.join()
        with pytest.raises(WorkerError, match=r"worker \d exited with status -9 without a message "
                                              r"\(killed, or out of memory\?\); 3 batches unanswered"):
            next(answers)
    finally:
        answers.close()


def _interrupted_partial(tmp_path):
    """The partial file of a run stopped after its first batch (3 rows), and its output path."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(Interrupted):
        regenerate(make_prompts(), FakeEngine(fail_on_call=4), SETTINGS, out, progress=False)
    partial = tmp_path / "out.jsonl.partial"
    assert len(partial.read_bytes().splitlines()) == 3
    return out, partial


def test_a_batch_appended_twice_is_kept_once_and_the_file_is_the_uninterrupted_one(tmp_path):
    """Two runs continuing one file both append the batches they answer. A batch there twice
    counted as complete, the run answered the rest and then stopped at its very end with
    "does not hold exactly one row per prompt", as did every rerun: the file was stuck."""
    reference = tmp_path / "ref.jsonl"
    regenerate(make_prompts(), FakeEngine(), SETTINGS, reference, progress=False)
    out, partial = _interrupted_partial(tmp_path)
    lines = partial.read_bytes().splitlines(keepends=True)
    partial.write_bytes(b"".join(lines + lines))
    report = regenerate(make_prompts(), FakeEngine(), SETTINGS, out, progress=False)
    assert (report.num_reused, report.num_generated) == (3, 8)
    assert out.read_bytes() == reference.read_bytes()


def test_a_second_different_answer_to_one_id_is_refused_with_its_line(tmp_path):
    out, partial = _interrupted_partial(tmp_path)
    lines = partial.read_bytes().splitlines(keepends=True)
    other = json.loads(lines[1])
    other["messages"][-1]["content"] = "another answer"
    partial.write_bytes(b"".join(lines) + (json.dumps(other) + "\n").encode())
    with pytest.raises(RegenerationError, match=rf"{partial.name}, line 4: a second, different "
                                                rf"answer to id '{other['id']}' \(the first is on line 2"):
        regenerate(make_prompts(), FakeEngine(), SETTINGS, out, progress=False)


FULL_DISK_RUN = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from regenerate_helpers import SETTINGS, FakeEngine, make_prompts
from draftforge.data.regenerate import regenerate
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
try:
    regenerate(make_prompts(), FakeEngine(), SETTINGS, {out!r}, progress=False)
except OSError as err:
    print(err.errno, err.filename)
"""


def test_a_write_that_fails_names_the_file_and_a_rerun_finishes_it_identically(tmp_path):
    """A full disk (here: a file size limit) failed the append of a batch with an OSError
    naming no file ("[Errno 28] No space left on device"), which the command printed as a
    traceback; the buffered handle's close repeated it."""
    reference = tmp_path / "ref.jsonl"
    regenerate(make_prompts(), FakeEngine(), SETTINGS, reference, progress=False)
    first_batch = len(b"".join(reference.read_bytes().splitlines(keepends=True)[:3]))
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    limit = first_batch + 100  # the second batch's write is cut inside its first line
    script = FULL_DISK_RUN.format(tests=str(Path(__file__).parent), limit=limit, out=str(out))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{errno.EFBIG} {partial}\n"
    assert partial.stat().st_size == limit and not out.exists()
    report = regenerate(make_prompts(), FakeEngine(), SETTINGS, out, progress=False)
    assert (report.num_reused, report.num_generated) == (3, 8)
    assert out.read_bytes() == reference.read_bytes()
