"""``draftforge train``'s checks before anything starts (review round 7): tensor-parallel groups
on the CPU, the GPUs a dry run plans, restarts without ``train.resume: auto``, and a dry run
that cannot know the target's shape."""

from __future__ import annotations

import pytest
from splitserve_helpers import tiny_recipe

from draftforge.config import RecipeError, load_recipe
from draftforge.splitserve import launch
from draftforge.splitserve.roles import split_problems, tensor_parallel_problems

CPU_TP = ["target.backend=sglang", "split.target_ranks=[0,2]", "split.trainer_ranks=[1]",
          "split.target_tensor_parallel=2"]


def _tensor_parallel(problems: list[str]) -> list[str]:
    return [p for p in problems if p.startswith("split.target_tensor_parallel")]


def test_a_cpu_tensor_parallel_group_needs_no_consecutive_gpus(tmp_path):
    """Over gloo the target ranks run on the CPU: ranks 0 and 2 may form a group there. On
    GPUs (NCCL) they would take GPUs 0 and 2, which SGLang cannot place as one group."""
    recipe = tiny_recipe(tmp_path)
    cpu = load_recipe(recipe, CPU_TP)
    assert _tensor_parallel(split_problems(cpu, world_size=3, cuda_devices=0)) == []
    gpu = load_recipe(recipe, [*CPU_TP, "split.comm_backend=nccl", "train.device=cuda"])
    problem, = _tensor_parallel(split_problems(gpu, world_size=3, cuda_devices=3))
    assert "target ranks [0, 2] form one tensor-parallel group" in problem
    assert "node-local GPUs [0, 2]" in problem
    # a group over two nodes is refused on the CPU too: its ranks meet on a loopback port
    spans = tensor_parallel_problems(cpu.split.model_copy(update={"num_nodes": 2}), per_node=2,
                                     on_gpus=False)
    assert len(spans) == 1 and "target ranks [0, 2] spans nodes [0, 1]" in spans[0]


def test_a_dry_run_plans_the_gpus_of_a_group_without_a_device_list(tmp_path, capsys):
    """The target named on GPU 0, trainer ranks 1 and 2 on their LOCAL_RANK GPUs 1 and 2: three
    GPUs, which the dry run plans instead of refusing GPUs 1 and 2 as missing."""
    recipe = tiny_recipe(tmp_path, trainers=2)
    nccl = ["split.target_devices=[0]", "split.comm_backend=nccl", "train.device=cuda"]
    assert launch.planned_gpus(load_recipe(recipe, nccl)) == 3
    assert launch.main([str(recipe), *nccl, "--dry-run"]) == 0
    assert "memory estimate per trainer rank" in capsys.readouterr().out
    # a real conflict is still refused: the target named on GPU 1, where trainer rank 1 goes
    with pytest.raises(RecipeError, match=r"ranks \[0, 1\] would share GPU 1"):
        launch.main([str(recipe), "split.target_devices=[1]", *nccl[1:], "--dry-run"])


def test_a_dry_run_of_a_cuda_trainer_plans_a_gpu(tmp_path, capsys):
    """train.device cuda over gloo: one GPU (the trainer's current one); with comm_backend auto
    on a GPU machine the samples go over NCCL, one GPU per rank."""
    recipe = tiny_recipe(tmp_path)
    gloo = ["train.device=cuda", "split.comm_backend=gloo"]
    assert launch.planned_gpus(load_recipe(recipe, gloo)) == 1
    assert launch.main([str(recipe), *gloo, "--dry-run"]) == 0
    auto = ["train.device=cuda", "split.comm_backend=auto"]
    assert launch.planned_gpus(load_recipe(recipe, auto)) == 2
    assert launch.main([str(recipe), *auto, "--dry-run"]) == 0
    assert launch.planned_gpus(load_recipe(recipe, ["train.device=cpu"])) == 0
    capsys.readouterr()


@pytest.mark.parametrize("resume", ["never", "PATH"])
def test_restarts_without_resume_auto_are_refused_before_anything_starts(resume, tmp_path,
                                                                           monkeypatch):
    """--max-restarts restarts the job from the newest checkpoint: with train.resume never (or
    a fixed checkpoint) a restart would start over, or be refused below the checkpoints the
    failed job wrote. Refused at once, naming the key and where it was set."""
    recipe = tiny_recipe(tmp_path)
    if resume == "PATH":
        resume = str(tmp_path / "run" / "checkpoints" / "step_4")
    starts = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: starts.append(k) or 0)
    with pytest.raises(RecipeError) as caught:
        launch.main([str(recipe), f"train.resume={resume}", "--max-restarts", "2"])
    problem, = caught.value.problems
    assert problem.startswith(f"command line 'train.resume={resume}': train.resume: "
                              "--max-restarts 2 restarts a failed job")
    assert "needs train.resume: auto" in problem
    assert starts == []
    if resume == "never":  # no restarts asked: the job starts
        assert launch.main([str(recipe), "train.resume=never", "--max-restarts", "0"]) == 0
        assert len(starts) == 1
    assert launch.main([str(recipe), "train.resume=auto", "--max-restarts", "2"]) == 0


def test_a_dry_run_without_the_targets_shape_is_an_input_error(tmp_path, capsys):
    """A target folder without its config.json and no target.shape: the dry run cannot size
    the draft; it says so (status 2, no traceback)."""
    from draftforge.cli import main as cli_main

    (tmp_path / "model").mkdir()
    recipe = tiny_recipe(tmp_path, overrides={"target.model": str(tmp_path / "model"),
                                              "target.shape": None})
    assert cli_main(["train", str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftforge train: invalid recipe:\n")
    assert f"target.model: {str(tmp_path / 'model')!r} holds no config.json" in err
    assert "or declare target.shape" in err and "Traceback" not in err
