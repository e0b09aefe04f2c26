"""Review round 49 of the launcher (splitserve/launch.py): the time ranks get between SIGTERM
and SIGKILL, and the ranks of its own node checked."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("backend, term_s", [("hf", 5.0), ("sglang", 45.0)])
def test_an_sglang_target_gets_time_to_close_its_runner_before_sigkill(tmp_path, monkeypatch, backend, term_s):
    """The launcher SIGKILLed ranks 5 s after SIGTERM; an SGLang target rank closing its
    feature runner waits up to 30 s for its children's batch and 10 s after their SIGTERM."""
    from splitserve_helpers import tiny_recipe

    from draftforge.splitserve import launch

    asked: list[float] = []

    def job(*args, term_s, **kwargs):
        asked.append(term_s)
        return 0

    monkeypatch.setattr(launch, "run_ranks", job)
    monkeypatch.setattr(launch, "preflight", lambda cfg, **kwargs: None)  # the target is not loaded here
    from draftforge.splitserve import sglang_backend

    monkeypatch.setattr(sglang_backend, "require_sglang", lambda: sglang_backend.SGLANG_VERSION)  # not installed here
    # a target folder SGLang could load (a random target is refused with the recipe); its
    # config.json has the tiny random target's shape, and nothing is loaded here
    import json

    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4,
        "hidden_size": 64, "vocab_size": 8192, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "rope_theta": 10000.0, "max_position_embeddings": 2048}))
    recipe = tiny_recipe(tmp_path, overrides={"target.model": str(folder), "target.shape": None})
    assert launch.main([str(recipe), f"target.backend={backend}"]) == 0
    assert asked == [term_s]


@pytest.mark.parametrize("node, refused", [(0, False), (1, True)])
def test_the_launcher_checks_the_ranks_of_its_own_node(tmp_path, monkeypatch, node, refused):
    """A two-node gloo split on machines without GPUs, train.device cuda: node 0 runs the
    target rank alone (on the CPU) and starts; node 1 runs the trainer and is refused."""
    from splitserve_helpers import tiny_recipe

    from draftforge.config import RecipeError
    from draftforge.splitserve import launch

    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(launch, "check_master_port", lambda port: None)
    monkeypatch.setattr(launch, "preflight", lambda cfg, **kwargs: None)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    recipe = tiny_recipe(tmp_path, overrides={"split.num_nodes": 2, "split.comm_backend": "gloo",
                                              "train.device": "cuda"})
    args = [str(recipe), "--node-rank", str(node), "--master-addr", "10.0.0.5"]
    if refused:
        with pytest.raises(RecipeError, match="train.device: cuda, but no CUDA GPU is visible"):
            launch.main(args)
        assert not started
    else:
        assert launch.main(args) == 0
        assert len(started) == 1
