"""``make gpu-check`` on a CPU, round 8: states that are not finite fail checks 1 and 3, an
interrupted check stops the command it started, and SGLang's ranks keep gloo and NCCL on
loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from draftforge.splitserve import gpu_check as G

NAN, INF = float("nan"), float("inf")


def _features(seed: int = 0):
    """Transformers-side layers 0..4 [2, 5, 4] and final, SGLang's aux for layers 1 and 3 equal
    to them, and a full mask."""
    generator = torch.Generator().manual_seed(seed)
    hf = {layer: torch.randn(2, 5, 4, generator=generator) for layer in range(5)}
    final = torch.randn(2, 5, 4, generator=generator)
    aux = torch.cat([hf[1], hf[3]], dim=-1)
    return hf, final, aux, torch.ones(2, 5, dtype=torch.long)


def test_check_one_fails_on_states_that_are_not_finite():
    """A NaN inside the mask made every error NaN, and NaN > tol is False: check 1 passed,
    saying "every layer within 0.08 (worst 0)"."""
    hf, final, aux, mask = _features()
    passed, _, _ = G.compare_features(hf, final, aux, final.clone(), [1, 3], mask)
    assert passed  # the same states: the comparison itself is sound

    bad_aux = aux.clone()
    bad_aux[0, 2, 1] = NAN  # layer 1's slot (the first 4 columns), one token
    passed, figures, reason = G.compare_features(hf, final, bad_aux, final.clone(), [1, 3], mask)
    assert not passed and "layer 1" in reason and "layer 3" not in reason
    assert figures["err_l3"] == 0.0

    bad_final = final.clone()
    bad_final[1, 4, 0] = INF
    passed, _, reason = G.compare_features(hf, final, aux, bad_final, [1, 3], mask)
    assert not passed and reason.startswith("final state")


def test_export_check_counts_a_nan_facing_a_number_as_a_difference():
    """A NaN in the loaded export where the checkpoint holds a number gave max_abs_diff 0:
    check 3 reported "loads back bit-identical"."""
    trained = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}
    loaded = {"w": torch.tensor([1.0, NAN, 3.0]), "b": torch.tensor([0.5])}
    assert G.compare_states(trained, loaded) == (2, INF, [])
    # the NaN on the other side, and an infinity facing a number
    assert G.compare_states({"w": torch.tensor([NAN])}, {"w": torch.tensor([1.0])})[1] == INF
    assert G.compare_states({"w": torch.tensor([1.0])}, {"w": torch.tensor([INF])})[1] == INF
    # equal values count 0, NaN against NaN and an infinity against itself included
    same = torch.tensor([1.0, NAN, INF, -INF])
    assert G.compare_states({"w": same}, {"w": same.clone()}) == (1, 0.0, [])
    assert G.compare_states({"w": torch.tensor([1.0, 2.0])},
                            {"w": torch.tensor([1.0, 2.5])}) == (1, 0.5, [])


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_an_interrupted_check_stops_the_command_it_started(tmp_path, how):
    """run_logged starts its command in a session of its own; interrupted (Ctrl-C on
    ``make gpu-check``, or the parent's SIGTERM to a check child, which _child_main turns into
    SystemExit) it returned without stopping it, so ``draftforge train`` kept the GPU."""
    pid_file = tmp_path / "command.pid"
    script = (
        "import pathlib, signal, sys\n"
        "from draftforge.splitserve import gpu_check as G\n"
        "def stopped(signum, frame):\n"
        "    raise SystemExit(128 + signum)\n"
        "signal.signal(signal.SIGTERM, stopped)\n"
        "print('go', flush=True)\n"
        f"G.run_logged(['sh', '-c', 'echo $$ > {pid_file}; exec sleep 60'],\n"
        f"             log=pathlib.Path({str(tmp_path / 'logs' / 'x.log')!r}), timeout_s=60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline, "the command did not start"
        time.sleep(0.05)
    command_pid = int(pid_file.read_text())
    proc.send_signal(getattr(signal, how))
    proc.wait(timeout=60)
    try:
        gone = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(command_pid, 0)
            except ProcessLookupError:
                gone = True
                break
            time.sleep(0.05)
        assert gone, f"the command (pid {command_pid}) outlived the interrupted run_logged"
    finally:
        try:
            os.killpg(command_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sglangs_ranks_keep_gloo_and_nccl_on_loopback(monkeypatch):
    """Check 1's feature runner and check 4's server start SGLang's own torch.distributed
    ranks; without GLOO_SOCKET_IFNAME gloo listens on the host name's interface, and NCCL's
    bootstrap never picks lo unless told."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = G.child_env()
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # an explicit choice is respected
    assert G.child_env()["GLOO_SOCKET_IFNAME"] == "ib0"


FAKE_SERVER = """
import http.server, json, os, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # /health
        self.send_response(200)
        self.end_headers()

    def do_POST(self):  # /generate: the draft fails at its first decode, the server dies
        print("RuntimeError: DSPARK draft hidden size 576 does not match", flush=True)
        os._exit(1)

print("fake server up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_check_four_names_the_server_log_when_the_server_dies_mid_request(tmp_path, monkeypatch):
    """A server that died during /generate raised RemoteDisconnected/URLError out of
    serve_and_count: the FAIL line said only "RemoteDisconnected: Remote end closed
    connection", not which request nor the server log that holds the cause."""
    from draftforge.splitserve import gpu_check_serving as S

    setup = G.gpu_setup(tmp_path, 1)
    setup.log_dir.mkdir(parents=True)
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text('{"block_size": 8}')
    monkeypatch.setattr(S, "sglang_server_command",
                        lambda model, draft, port, *, block_size: [sys.executable, "-c", FAKE_SERVER,
                                                                    str(port)])
    outcome = S.serve_and_count(setup, "/models/smol", [[1, 2, 3]], time.monotonic() + 60,
                                draft_dir=draft_dir)
    assert isinstance(outcome, str), outcome
    assert outcome.startswith("/generate of prompt 0 failed")
    assert str(setup.log_dir / "sglang-server.log") in outcome
    assert "hidden size 576 does not match" in outcome
