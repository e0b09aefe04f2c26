"""Dry runs of the production recipes work on a CPU machine without the targets' weights."""

import shlex
import sys
from pathlib import Path

import pytest

from draftforge.splitserve.launch import main as train_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        # The published Ling-3.0-flash-dspark parameter count (model card), embeddings included.
        ("recipes/ling3-flash-dspark.yaml", "draft parameters: 1,363,707,905 with embeddings"),
        ("recipes/qwen3-8b-dspark.yaml", "draft parameters:"),
    ],
)
def test_production_recipe_dry_run(recipe, expected, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main([recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert expected in out
    assert "memory estimate per trainer rank" in out and "memory estimate per target rank" in out
    assert "world size 8; comm backend nccl" in out


# --------------------------------------------------------------------------- the target's size


def test_declared_target_parameters_replace_the_dense_estimate(capsys, monkeypatch):
    from draftforge.splitserve.config import TargetShape
    from draftforge.splitserve.dry_run import target_parameters

    shape = TargetShape(num_hidden_layers=2, hidden_size=8, vocab_size=10, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=16)
    # dense: 2 * V * H + L * (H * hd * (2*heads + 2*kv) + 3 * H * I + 2 * H) + H, hd = 4
    assert target_parameters(shape) == 2 * 10 * 8 + 2 * (8 * 4 * 6 + 3 * 8 * 16 + 16) + 8
    assert target_parameters(shape.model_copy(update={"num_parameters": 123})) == 123

    monkeypatch.chdir(ROOT)
    declared = 100_000_000_000
    assert train_main(["recipes/ling3-flash-dspark.yaml", "--dry-run",
                       f"target.shape.num_parameters={declared}"]) == 0
    weights = next(line for line in capsys.readouterr().out.splitlines() if "weights x2" in line)
    # bf16 weights split over tensor parallel 4, twice: SGLang's generation engine and
    # feature runner each hold a copy
    assert f"{declared:,} declared params" in weights
    assert weights.rstrip().endswith(f"{2 * declared * 2 / 4 / 2**30:.3f} GiB")
    assert train_main(["recipes/ling3-flash-dspark.yaml", "--dry-run"]) == 0
    weights = next(line for line in capsys.readouterr().out.splitlines() if "weights x2" in line)
    # the recipe leaves the heads and the MLP width to Ling's config.json: the formula would
    # count the section's placeholder defaults (4 heads, an MLP 128 wide), so no figure
    assert ("unknown, not counted: declare target.shape.num_parameters (a dense estimate would need "
            "num_attention_heads, num_key_value_heads, intermediate_size)") in weights
    assert weights.rstrip().endswith(" 0.000 GiB")
    assert target_parameters(TargetShape(num_hidden_layers=2, hidden_size=8, vocab_size=10)) is None


def test_num_parameters_must_be_positive(monkeypatch):
    from draftforge.config import RecipeError

    monkeypatch.chdir(ROOT)
    with pytest.raises(RecipeError, match="num_parameters"):
        train_main(["recipes/ling3-flash-dspark.yaml", "--dry-run", "target.shape.num_parameters=0"])


# --------------------------------------------------------------------------- several nodes

TWO_NODE = "recipes/ling3-flash-2node.yaml"


def _torchrun(node: int, addr: str, port: int = 29500) -> str:
    return (f"torchrun --nnodes=2 --nproc_per_node=8 --node_rank={node} --master_addr={addr} "
            f"--master_port={port} --rdzv-conf=timeout=960 -m draftforge.train {TWO_NODE}")


def test_two_node_dry_run_prints_each_nodes_ranks_and_command(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main([TWO_NODE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world size 16 over 2 nodes; comm backend nccl" in out
    plan = out[out.index("\nlaunch:\n"):].splitlines()
    assert "  node 0: ranks 0-7: target ranks 0-7, trainer ranks none; local GPUs 0-7 (LOCAL_RANK)" in plan
    assert "  node 1: ranks 8-15: target ranks none, trainer ranks 8-15; local GPUs 0-7 (LOCAL_RANK)" in plan
    for node in (0, 1):
        assert f"  on node {node}: draftforge train {TWO_NODE} --node-rank {node} --master-addr NODE0_ADDR" in plan
        assert f"    which runs: {_torchrun(node, 'NODE0_ADDR')}" in plan
    assert any("NODE0_ADDR: node 0's address" in line for line in plan)


def test_a_two_node_plan_over_gloo_names_local_processes_not_gpus(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main([TWO_NODE, "split.comm_backend=gloo", "train.device=cpu",
                       "split.target_devices=null", "split.trainer_devices=null",
                       "draft.attention_backend=sdpa", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("\nlaunch:\n"):].splitlines()
    assert "  node 0: ranks 0-7: target ranks 0-7, trainer ranks none; local processes 0-7 (LOCAL_RANK)" in plan
    assert any("listens on every interface at port 29500" in line for line in plan)
    assert "0.0.0.0" not in out


def test_two_node_dry_run_uses_the_given_rendezvous(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main([TWO_NODE, "--dry-run", "--master-addr", "10.0.0.5", "--master-port", "29600"]) == 0
    out = capsys.readouterr().out
    assert f"    which runs: {_torchrun(1, '10.0.0.5', 29600)}" in out
    assert "--node-rank 1 --master-addr 10.0.0.5 --master-port 29600" in out
    assert "NODE0_ADDR" not in out
    # none given: the placeholder; loopback or the wildcard given is refused as a start refuses
    # it (tests/test_refusals_r63.py)
    assert train_main([TWO_NODE, "--dry-run"]) == 0
    assert _torchrun(0, "NODE0_ADDR") in capsys.readouterr().out


def test_one_node_dry_run_prints_its_rank_command_and_loopback_store(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_main(["recipes/tiny-debug.yaml", "train.steps=3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    # the command as one could type it: the interpreter first (it was left out)
    assert (f"  one node, 2 processes (ranks 0-1), each running: {shlex.quote(sys.executable)} -m "
            "draftforge.train recipes/tiny-debug.yaml train.steps=3") in out
    assert "  rendezvous store hosted by draftforge train on 127.0.0.1 (loopback only)" in out
    assert ("  the same job by hand: torchrun --standalone --nproc_per_node=2 "
            "--local-addr=127.0.0.1 -m draftforge.train recipes/tiny-debug.yaml train.steps=3") in out


@pytest.mark.parametrize(
    ("args", "messages"),
    [
        (["split.num_nodes=3", "--dry-run"], ["split.num_nodes: 3 nodes cannot share world_size 16"]),
        (["split.target_devices=[0,1,2,3,4,5,6,7]", "--dry-run"], ["split.target_devices: with split.num_nodes 2"]),
        ([], ["--node-rank: split.num_nodes is 2", "--master-addr: split.num_nodes is 2"]),
        (["--node-rank", "2", "--master-addr", "10.0.0.5"], ["(0..1;", "got 2"]),
        (["--node-rank", "1", "--master-addr", "localhost"], ["localhost (loopback) cannot offer"]),
        (["--node-rank", "0", "--master-addr", "::1"], ["::1 (loopback)"]),
        (["--node-rank", "0", "--master-addr", "0.0.0.0"], ["0.0.0.0 is the wildcard address"]),
    ],
)
def test_two_node_mistakes_are_refused_before_anything_starts(args, messages, monkeypatch):
    from draftforge.config import RecipeError
    from draftforge.errors import InputError

    monkeypatch.chdir(ROOT)
    started = []
    monkeypatch.setattr("draftforge.splitserve.launch.run_torchrun", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: started.append(a))
    # the split's own problems are the recipe's; --node-rank and --master-addr that do not fit it
    # are the options' (session 56: they were headed "invalid recipe")
    wrong = RecipeError if args and args[0].startswith("split.") else InputError
    with pytest.raises(wrong) as err:
        train_main([TWO_NODE, *args])
    for message in messages:
        assert message in str(err.value)
    assert not started


def test_a_split_no_node_layout_fits_is_refused_when_the_recipe_loads(tmp_path):
    """config show, the dry run and train all refuse it, at the key's line or override."""
    from draftforge.config import RecipeError, load_recipe

    with pytest.raises(RecipeError) as err:
        load_recipe(ROOT / TWO_NODE, ["split.num_nodes=3"])
    assert "command line 'split.num_nodes=3': split.num_nodes: 3 nodes cannot share world_size 16" in str(err.value)
    lines = (ROOT / TWO_NODE).read_text().splitlines()
    at = lines.index("split:") + 1
    lines.insert(at, "  target_devices: [0, 1, 2, 3, 4, 5, 6, 7]")
    path = tmp_path / "two.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecipeError, match=f"two.yaml:{at + 1}: split.target_devices: with split.num_nodes 2"):
        load_recipe(path)


def test_node_rank_on_a_one_node_recipe_is_refused(monkeypatch):
    from draftforge.errors import InputError

    monkeypatch.chdir(ROOT)
    for dry in ([], ["--dry-run"]):
        with pytest.raises(InputError, match="--node-rank 1: the recipe runs on one node"):
            train_main(["recipes/tiny-debug.yaml", "--node-rank", "1", *dry])


def test_loopback_addresses():
    from draftforge.splitserve.multinode import is_loopback, is_unspecified

    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert is_loopback("[::1]") and is_loopback("LOCALHOST")
    assert not is_loopback("10.0.0.5") and not is_loopback("node0.cluster") and not is_loopback("0.0.0.0")
    assert is_unspecified("0.0.0.0") and is_unspecified("::") and not is_unspecified("10.0.0.5")


@pytest.mark.distributed
def test_two_nodes_started_with_the_printed_commands_train(tmp_path):
    """Both "nodes" on this machine (rendezvous on loopback): node 0 gets rank 0, node 1 rank 1."""
    import os
    import subprocess

    from splitserve_helpers import free_port, metrics, tiny_recipe

    from draftforge.config import load_recipe
    from draftforge.splitserve.multinode import multinode_torchrun_command, node_layout

    recipe = tiny_recipe(tmp_path, steps=3, overrides={"split.num_nodes": 2})
    layout = node_layout(load_recipe(recipe))
    assert (layout.num_nodes, layout.nproc_per_node) == (2, 1)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for node in (1, 0):  # the order nodes come up in does not matter to a static rendezvous
        logs.append(tmp_path / f"node{node}.log")
        command = multinode_torchrun_command(str(recipe), [], layout, node_rank=node,
                                             master_addr="127.0.0.1", master_port=port)
        procs.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=logs[-1].open("w"),
                                      stderr=subprocess.STDOUT))
    try:
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    node1, node0 = (log.read_text() for log in logs)
    assert codes == [0, 0], node0[-3000:] + node1[-3000:]
    assert "[rank 0 target]" in node0 and "[rank 1" not in node0
    assert "[rank 1 trainer]" in node1 and "[rank 0" not in node1
    steps = [r["step"] for r in metrics(tmp_path / "run") if "loss" in r]
    assert steps[-1] == 3


def test_a_trainer_node_without_the_targets_config_refuses_to_guess_its_rope_base(capsys, monkeypatch):
    """Node 1 of the 2-node recipe runs every trainer and has no /models/Ling-3.0-flash: the
    draft's RoPE base (the target's unless draft.rope_theta sets one) used to come out as
    target.shape's default, 10000, so the two nodes resolved different drafts and node 1
    trained and exported the wrong one. Now a trainer node refuses, node 0 (targets only)
    does not, and a declared rope_theta is taken as given."""
    from draftforge.config import RecipeError, load_recipe

    monkeypatch.chdir(ROOT)
    assert load_recipe(ROOT / TWO_NODE).draft.rope_theta is None
    declared = load_recipe(ROOT / TWO_NODE, ["target.shape.rope_theta=6e6"])
    assert declared.draft.rope_theta == 6e6
    assert load_recipe(ROOT / TWO_NODE, ["draft.rope_theta=5e5"]).draft.rope_theta == 5e5
    started = []
    monkeypatch.setattr("draftforge.splitserve.launch.run_torchrun", lambda *a, **k: started.append(a) or 0)
    rendezvous = ["--master-addr", "10.0.0.5"]
    with pytest.raises(RecipeError) as err:
        train_main([TWO_NODE, "--node-rank", "1", *rendezvous])
    assert str(err.value) == (
        "draft.rope_theta: the target's RoPE base is not known on this machine "
        "(/models/Ling-3.0-flash/config.json cannot be read here and target.shape does not "
        "declare rope_theta); copy the target's config.json to that path, or declare "
        "target.shape.rope_theta (or draft.rope_theta) in the recipe")
    # node 0 and a declared base get past that check (to the next: no GPU on this machine)
    for args in (["--node-rank", "0"], ["--node-rank", "1", "target.shape.rope_theta=6e6"]):
        with pytest.raises(RecipeError) as err:
            train_main([TWO_NODE, *args, *rendezvous])
        assert "rope_theta" not in str(err.value) and "CUDA GPUs and none is visible" in str(err.value)
    assert not started
    # the dry run plans the job anyway and says what training would do; it compares a
    # checkpoint with no guessed draft (10000 would call node 1's own checkpoints foreign)
    from draftforge.splitserve.launch import _model_config

    assert _model_config(load_recipe(ROOT / TWO_NODE)) is None
    assert _model_config(declared)["rope_theta"] == 6e6
    assert train_main([TWO_NODE, "--dry-run"]) == 0
    assert "note: training would refuse: draft.rope_theta: the target's RoPE base" in capsys.readouterr().out


def test_a_failed_node_without_trainers_points_to_the_trainers_checkpoints(tmp_path, capsys, monkeypatch):
    """Checkpoints are written on the trainers' node: node 0 (the target here) has none of
    them, and used to say the same command would start over."""
    from splitserve_helpers import tiny_recipe

    recipe = tiny_recipe(tmp_path, steps=3, overrides={"split.num_nodes": 2})
    monkeypatch.setattr("draftforge.splitserve.launch.run_torchrun", lambda *a, **k: 1)
    last = {}
    for node in (0, 1):
        assert train_main([str(recipe), "--node-rank", str(node), "--master-addr", "10.0.0.5"]) == 1
        last[node] = capsys.readouterr().err.splitlines()[-1]
    assert last[0].endswith(f"Rerun the same command on every node to resume from the newest "
                            f"checkpoint in {tmp_path / 'run'} on the trainers' node (train.resume=auto).")
    assert last[1].endswith("No checkpoint was written: once the cause is fixed, the same command starts over.")
