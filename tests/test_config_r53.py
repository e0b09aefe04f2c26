"""Session 53 (a CLI review): values the recipe accepted that torch refused once the ranks ran,
with a traceback and exit status 1 (which --max-restarts would even restart)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_r15 import _run


@pytest.mark.parametrize("value,said", [
    ("1e10", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # torch's store refused it
    ("1e300", "split.peer_timeout_s: must be less than or equal to 1000000000"),  # timedelta overflowed
    ("0.01", "split.peer_timeout_s: must be greater than or equal to 5"),  # the rendezvous timed out
])
def test_a_peer_timeout_torch_cannot_take_is_refused_with_the_recipe(value, said, capsys):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml"
    code, _, err = _run(["config", "show", recipe, f"split.peer_timeout_s={value}"], capsys)
    assert code == 2 and said in err and "Traceback" not in err, err
