"""Round 43: the evaluator's calibration file.

1. ``write_calibration`` refused a temperature <= 0 but let NaN and infinity through, which
   ``json`` writes as ``NaN`` / ``Infinity``: not JSON, and SGLang's reader refuses the file.
"""

from __future__ import annotations

import math

import pytest

from draftforge.eval.calibration import write_calibration


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_a_calibration_with_a_temperature_that_is_not_finite_and_positive_is_not_written(tmp_path, bad):
    path = tmp_path / "calibration.json"
    with pytest.raises(ValueError, match="finite and > 0"):
        write_calibration(path, {"temperatures": [1.2, bad], "ece_before": [0.1, 0.2], "ece_after": [0.05, 0.1]})
    assert not path.exists()


def test_a_finite_calibration_is_written_as_strict_json(tmp_path):
    import json

    path = write_calibration(tmp_path / "c.json", {"temperatures": [1.25, 0.5], "ece_before": [0.1, 0.2],
                                                   "ece_after": [0.05, 0.1]})
    written = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON {name}"))
    assert written == {"temperatures": [1.25, 0.5], "ece_before": [0.1, 0.2], "ece_after": [0.05, 0.1]}
