"""``draftforge bench target`` on the real SmolLM2 target: its table and machine-readable last line."""

from __future__ import annotations

import pytest
import torch

from draftforge.splitserve.bench_target import main


@pytest.mark.integration
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_bench_target_reports_both_ops(capsys, temperature):
    before = torch.get_num_threads()
    try:
        assert main(["--dtypes", "bfloat16", "--batch-sizes", "2", "--seq-len", "16",
                     "--new-tokens", "4", "--temperature", temperature]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out.strip().splitlines()
    assert ("greedy" if temperature == "0" else "sampled (temperature 0.7)") in out[0]
    table = {line.split()[0]: line.split() for line in out if line.startswith(("features", "generate"))}
    assert table["features"][3] == "32"  # 2 rows x 16 tokens
    assert 2 <= int(table["generate"][3]) <= 8  # 1 to 4 new tokens per row
    fields = dict(item.split("=") for item in out[-1].split())
    assert set(fields) == {"features_tok_s", "generate_tok_s"}
    assert float(fields["features_tok_s"]) > 0 and float(fields["generate_tok_s"]) > 0
