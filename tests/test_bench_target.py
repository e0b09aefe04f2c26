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


@pytest.mark.parametrize("value", ["1,x", "1,-2", ","])
def test_bad_layers_are_refused_naming_the_option(capsys, value):
    """``--layers 1,x`` ended in a bare ValueError traceback after the parse."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--layers", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --layers" in err and "Traceback" not in err


def test_layers_parse_into_ids():
    from draftforge.splitserve.bench_target import _parse

    assert _parse(["--layers", "0, 3,27"]).layers == [0, 3, 27]
    assert _parse([]).layers == [1, 14, 27]
