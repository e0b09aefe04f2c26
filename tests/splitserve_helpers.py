"""Shared helpers of the SplitServe tests: a tiny recipe, small data, ranks spawned by hand."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

WORDS = (
    "alpha beta gamma delta river stone cloud paper green seven orange window music table "
    "garden winter silver candle forest bridge"
).split()


def write_conversations(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` short two-turn conversations with repetitive answers (learnable by a draft)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        topic = rng.sample(WORDS, 3)
        answer = " ".join(topic * rng.randint(3, 6))
        rows.append({
            "id": f"conv-{i:04d}",
            "messages": [
                {"role": "user", "content": f"Repeat {' '.join(topic)} a few times."},
                {"role": "assistant", "content": answer},
            ],
        })
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_recipe(tmp: Path, *, trainers: int = 1, steps: int = 12, overrides: dict | None = None,
                num_conversations: int = 48) -> Path:
    """A recipe: random target (SmolLM2's tokenizer cut to 8,192 tokens), a tiny draft."""
    data = write_conversations(tmp / "convs.jsonl", num_conversations)
    recipe = {
        "target": {
            "model": "random", "dtype": "float32", "seed": 0,
            "shape": {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 8192,
                      "num_attention_heads": 4, "num_key_value_heads": 2,
                      "intermediate_size": 128},
            "generation": {"max_new_tokens": 16, "batch_size": 4},
        },
        "draft": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 128,
                  "target_layer_ids": [0, 1, 2], "block_size": 4, "mask_token_id": 16,
                  "markov_rank": 8},
        "data": {"train_files": [str(data)], "regenerate": False, "max_length": 96,
                 "min_loss_tokens": 4, "overlap_check": False},
        "split": {"target_ranks": [0], "trainer_ranks": list(range(1, 1 + trainers)),
                  "max_in_flight": 4, "token_budget": 256, "feature_batch_size": 4,
                  "peer_timeout_s": 60},
        "train": {"strategy": "single" if trainers == 1 else "fsdp2", "dtype": "float32",
                  "num_anchors": 8, "steps": steps, "lr": 3e-3, "warmup_ratio": 0.0,
                  "log_interval": 4, "checkpoint_interval": 4, "keep_last": 3,
                  "output_dir": str(tmp / "run"), "device": "cpu"},
    }
    for key, value in (overrides or {}).items():
        node = recipe
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process started later to listen on (a job's store).

    Taken below the kernel's ephemeral range (as ``sglang_runner.free_port`` takes SGLang's,
    from 22000 up: these are below those) where there is room: a port the kernel chose
    (``bind(port 0)``) is one it may give the next outgoing connection of any other test
    (gloo opens many) in the seconds before our process binds it. Each pytest-xdist worker
    draws from a slice of its own, and no port twice in one process."""
    from draftforge.splitserve.sglang_runner import _ephemeral_low

    # [low, high): never handed out by the kernel, nor by sglang_runner.free_port (22000 up)
    low, high = 10000, min(_ephemeral_low(), 22000)
    if high - low >= 1000:
        workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % workers
        width = (high - low) // workers
        low, high = low + worker * width, low + (worker + 1) * width
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(low, high)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as sock:  # no room below the range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script_rank(source: str, folder: Path, name: str) -> str:
    """Write ``source`` to ``folder/name`` and run it as ``python SCRIPT RUN_DIR PORT`` (one
    process that starts its own process group on a free port, writing its run under
    ``folder/run``); it must exit 0. Returns its stdout."""
    script = folder / name
    script.write_text(source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run([PYTHON, str(script), str(folder / "run"), str(free_port())], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def rank_env(rank: int, world: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    return env


def spawn_ranks(recipe: Path, world: int, *extra: str, log_dir: Path) -> list[subprocess.Popen]:
    """Start every rank of ``recipe`` as ``python -m draftforge.train`` (what torchrun runs)."""
    port = free_port()
    procs = []
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        out = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [PYTHON, "-m", "draftforge.train", str(recipe), *extra],
            env=rank_env(rank, world, port), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
        ))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes; kills every rank still running after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    other.kill()
            raise
    return codes


def read_logs(log_dir: Path, world: int) -> list[str]:
    return [(log_dir / f"rank{r}.log").read_text() for r in range(world)]


def metrics(run_dir: Path) -> list[dict]:
    """The step records of ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- wire workers
# Run as ``python -c "import splitserve_helpers as h; h.<worker>(OUT)"`` with rank_env().


def _init_gloo():
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.new_group([0, 1], backend="gloo")


def _finish() -> None:
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def wire_samples(seed: int = 0):
    """Deterministic test samples in fp32 (what a float32 target produces)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for index, length in enumerate((5, 1, 17)):
        out.append((
            f"sample-{index}-é✓",
            torch.randint(0, 49152, (length,), generator=gen),
            torch.rand(length, generator=gen) > 0.5,
            torch.randn(length, 12, generator=gen) * 3,
            torch.randn(length, 4, generator=gen),
        ))
    return out


def transport_worker(out: str) -> None:
    """Rank 0 sends samples, a tensor and END; rank 1 checks them; then HELLO and ACK back."""
    import torch

    from draftforge.splitserve import transport as T

    rank, acks = _init_gloo()
    samples = wire_samples()
    embed = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    ids = {"a": 17, "b-ü": 0, "conv-0001#e2": None, "": 3}  # tokens: 0 dropped, None unrecorded
    result = {}
    if rank == 0:
        T.send_tensor(embed, 1)
        for n, (sid, tok, mask, aux, final) in enumerate(samples):
            T.send_sample(1, sid, tok, mask, aux, final, seq_no=n, stats=(1_500_000, 250_000, 42, 2_000_000),
                          chunk_end=n % 2 == 1)
        T.send_end(1)
        listener = T.AckListener([1], group=acks)
        result["hello"] = sorted(listener.result().items())
        listener.join(30)  # its thread ends at the trainer's stop
        result["ack"] = [listener.consumed[1], sorted(listener.stopped)]
    else:
        got = T.recv_tensor(0)
        result["tensor_exact"] = bool(torch.equal(got, embed)) and got.dtype == embed.dtype
        checks = []
        while (wire := T.recv_sample(0)) is not None:
            sid, tok, mask, aux, final = samples[len(checks)]
            checks.append({
                "id": wire.sample_id == sid,
                "ids": torch.equal(wire.input_ids, tok),
                "mask": torch.equal(wire.loss_mask, mask),
                "aux": torch.equal(wire.aux, aux.to(torch.bfloat16)) and wire.aux.dtype == torch.bfloat16,
                "final": torch.equal(wire.final, final.to(torch.bfloat16)),
                "seq_no": wire.seq_no == len(checks),
                "stats": wire.producer_stats == {"busy_s": 1.5, "idle_s": 0.25, "tokens": 42.0, "wall_s": 2.0},
                "chunk_end": wire.chunk_end == (len(checks) % 2 == 1),
            })
        result["samples"] = checks
        T.send_hello(ids, 0, group=acks)
        T.send_ack(0, 3, stop=True, group=acks)
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(result))
    _finish()


def backpressure_worker(out: str, credits: int = 3, count: int = 24) -> None:
    """Rank 0 sends ``count`` samples under ``credits``; rank 1 takes them slowly."""
    import time

    import torch

    from draftforge.splitserve import transport as T
    from draftforge.splitserve.consumer import ConsumerStream

    rank, acks = _init_gloo()
    result = {}
    if rank == 0:
        gate = T.CreditGate([1], credits, group=acks, timeout_s=60)
        outstanding = []
        for n in range(count):
            assert gate.acquire([1]) == 1
            T.send_sample(1, f"s{n}", torch.arange(4), torch.ones(4, dtype=torch.bool),
                          torch.zeros(4, 2), torch.zeros(4, 2), seq_no=n)
            gate.note_sent(1)
            outstanding.append(gate.outstanding(1))
        T.send_end(1)
        assert gate.wait_all_stopped(60)
        gate.join(10)
        result = {"max_outstanding": gate.max_outstanding, "outstanding": outstanding}
    else:
        receiver = T.SampleReceiver([0], credits=credits)
        stream = ConsumerStream(receiver, ack_group=acks)
        seen, depths = [], []
        for sample in stream.samples():
            time.sleep(0.05)  # a slow trainer: the producer must wait for credits
            depths.append(receiver.depth())
            seen.append(sample.sample_id)
        stream.stop(timeout_s=60)
        result = {"seen": seen, "max_depth": stream.max_depth, "depths": depths}
    Path(out).with_suffix(f".{rank}.json").write_text(json.dumps(result))
    _finish()


def tensor_parallel_member_worker(out: str) -> None:
    """Ranks 0-1 are one tensor-parallel target group (0 leads), rank 2 a trainer. The member
    waits in ``wait_for_leader`` until the leader's ``release_members``; in a folder named
    ``dies`` the leader exits instead, and the member must stop with PeerDied."""
    import time

    from draftforge.config import load_recipe
    from draftforge.splitserve import roles
    from draftforge.splitserve import transport as T

    tmp = Path(out).parent / f"recipe-{os.environ['RANK']}"
    tmp.mkdir(exist_ok=True)
    recipe = tiny_recipe(tmp, overrides={"split.target_ranks": [0, 1], "split.trainer_ranks": [2],
                                         "split.target_tensor_parallel": 2})
    ctx = roles.RankContext(load_recipe(recipe), int(os.environ["RANK"]), 3)
    dies = Path(out).parent.name == "dies"
    result: dict = {"role": ctx.role, "producers": list(ctx.topology.producers),
                    "leader": ctx.tp_leader, "in_group": ctx.tp_group is not None}
    if ctx.rank == 0:
        time.sleep(2.0)
        if dies:
            os._exit(7)
        roles.release_members(ctx, engine=None)
    elif ctx.rank == 1:
        begin = time.monotonic()
        try:
            roles.wait_for_leader(ctx)
            result["outcome"] = "released"
        except T.PeerDied as exc:
            result["outcome"] = f"PeerDied: {exc}"
        result["waited_s"] = time.monotonic() - begin
    Path(out).with_suffix(f".{ctx.rank}.json").write_text(json.dumps(result))
    if not dies:
        roles._finish(ctx)
    os._exit(0)


def run_on_ranks(code: str, world: int, timeout: float) -> tuple[list[int], list[str]]:
    """Run ``python -c code`` as ranks 0..world-1 of one job, with tests/ importable; the
    exit codes and each rank's output."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port)
        env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
        procs.append(subprocess.Popen(
            [PYTHON, "-c", code],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    codes = wait_all(procs, timeout)
    return codes, [p.stdout.read() for p in procs]


def run_workers(worker: str, out: Path, world: int = 2, timeout: float = 60) -> list[dict]:
    """Run ``worker`` on ``world`` ranks; the result each rank wrote."""
    codes, logs = run_on_ranks(f"import splitserve_helpers as h; h.{worker}({str(out)!r})", world, timeout)
    assert codes == [0] * world, logs
    return [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(world)]
