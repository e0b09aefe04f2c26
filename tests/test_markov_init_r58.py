"""Session 58: the bigram start's memory.

``bigram_scores`` built its float64 table out of place: ``counts + unigram``, the quotient
and its log each held another table, a peak of three (1.53 GiB resident at 8192 x 8192,
measured), which the dry run did not mention. It is built in place now, and the dry run
states the table beside what it coexists with at start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from draftforge.config import load_recipe
from draftforge.splitserve.dry_run import dry_run
from draftforge.train.markov_init import bigram_scores

_MEASURE = r"""
import json, resource, torch
torch.set_num_threads(1)
from draftforge.train.markov_init import bigram_scores
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, 6000, (300,), generator=g).tolist() for _ in range(400)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rows, cols, scores = bigram_scores(seqs)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"table": scores.numel() * 8, "rise": after - before}))
"""


def test_the_table_is_built_in_place():
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout)
    assert measured["table"] > 250 * 2**20  # about 6000 x 6000 float64
    # out of place the peak rose by three tables (3.0x here); in place by one, plus the pairs
    assert measured["rise"] < 1.5 * measured["table"], measured


def test_the_scores_are_the_out_of_place_formula():
    seqs = [[1, 2, 3, 2, 3, 4, 1, 2], [2, 3, 4, 4, 1, 2, 5]]
    rows, cols, scores = bigram_scores(seqs)
    # by hand: counts of pairs, one pseudo-count as the unigram of next tokens, centred rows
    pairs = [(a, b) for s in seqs for a, b in zip(s, s[1:], strict=False)]
    nxt = torch.tensor([sum(b == c for _, b in pairs) for c in cols.tolist()], dtype=torch.float64)
    reference = []
    for a in rows.tolist():
        count = torch.tensor([sum(p == (a, c) for p in pairs) for c in cols.tolist()], dtype=torch.float64)
        row = torch.log((count + nxt / len(pairs)) / (sum(p[0] == a for p in pairs) + 1.0))
        reference.append(row - row.mean())
    torch.testing.assert_close(scores, torch.stack(reference), rtol=1e-12, atol=1e-12)


def test_the_dry_run_states_the_table_against_what_it_coexists_with():
    cfg = load_recipe("recipes/smollm2-cpu.yaml", ["train.markov_init=bigram"])
    report = dry_run(cfg)
    # by hand: 8192^2 x 8 bytes, and 4 x 8192 x (256 + 16) x 8 bytes of SVD work: 0.566 GiB
    table = (8192**2 * 8 + 4 * 8192 * 272 * 8) / 2**30
    assert f"and its SVD, up to {table:.3f} GiB" in report and "within the total above" in report
    assert "markov_init bigram" not in dry_run(load_recipe("recipes/smollm2-cpu.yaml", []))
    # a rank-8 head: the step's gradients and moments are far smaller than the table
    small = dry_run(load_recipe("recipes/smollm2-cpu.yaml", ["train.markov_init=bigram", "draft.markov_rank=8"]))
    assert "so the trainer's peak may be up to" in small
