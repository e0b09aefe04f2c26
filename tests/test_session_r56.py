"""Session 56: the target rank's end-of-run counts of conversations its tokenisation cut or
dropped describe the data, not how many epochs happened to tokenise it; a recipe given as a
pipe is refused where the job would read it a second time."""

from __future__ import annotations

from splitserve_helpers import tiny_recipe


def test_conversations_cut_to_max_length_are_counted_once_whatever_the_epochs(tmp_path):
    """The count grew by the whole share each epoch tokenised, a chunk computed for an epoch the
    trainers never reached included: 3 epochs of data said three times the conversations cut."""
    from draftforge.config import load_recipe
    from draftforge.data.tokenize import tokenize_conversations
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import build_target

    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=12, overrides={
        "target.generation.batch_size": 4, "split.feature_batch_size": 4, "split.max_epochs": 3,
        "data.max_length": 68, "data.min_loss_tokens": 1}))
    conversations, regenerate = load_source_conversations(cfg)
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    source = SampleSource(cfg, engine, build_topology(cfg.split), 0, conversations=conversations,
                          regenerate=regenerate, log=lambda text: None)
    samples = list(source.samples())
    assert {s.sample_id.rpartition("#e")[2] for s in samples if "#e" in s.sample_id} == {"1", "2"}
    settings = cfg.target.generation
    # the conversations as the rank tokenised them: its regenerated answers, else the files' own
    answered = [c for index in sorted(source._answers) for c in source._answers[index]] or conversations
    _, once = tokenize_conversations(answered, engine.tokenizer, max_length=cfg.data.max_length,
                                     min_loss_tokens=cfg.data.min_loss_tokens,
                                     chat_template=settings.chat_template,
                                     enable_thinking=settings.enable_thinking)
    assert 0 < once.num_truncated < len(answered)
    assert (source.truncated, source.dropped_short) == (once.num_truncated, once.num_dropped_short)


def _pipe_recipe(tmp_path):
    import os

    tmp_path.mkdir(exist_ok=True)
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    return fifo


def test_a_recipe_in_a_pipe_is_refused_where_the_job_reads_it_again(tmp_path, capsys):
    """'draftforge train <(sed ... recipe.yaml)' passed the launcher's checks and every rank
    failed with 'no such recipe file' (the pipe was the launcher's); a FIFO blocked the ranks
    for good. Refused before it is read, by train, bench split and the demo."""
    from test_cli_r15 import _run

    fifo = _pipe_recipe(tmp_path)
    said = "not a regular file (a pipe such as bash's <(...), or a FIFO), whose text can be read once"
    for argv, why in ((["train", str(fifo)], "every rank of the job reads it again"),
                      (["bench", "split", str(fifo)], "the benchmark's ranks read it again"),
                      (["demo", str(fifo)], "the demo reads it again for each stage")):
        code, _, err = _run(argv, capsys)  # a FIFO with no writer: a read would block here
        assert code == 2, err
        assert f"{fifo}: {said}, and {why}: save the recipe to a file and pass that" in err, err


def test_a_dry_run_and_config_show_still_read_a_recipe_from_a_pipe(tmp_path, capsys):
    import threading
    from pathlib import Path

    from test_cli_r15 import _run

    text = (Path(__file__).resolve().parents[1] / "recipes" / "tiny-debug.yaml").read_text()
    for argv, shown in ((["train", "{}", "--dry-run"], "the same job by hand: torchrun"),
                        (["config", "show", "{}"], "# draftforge resolved recipe 'recipe'")):
        fifo = _pipe_recipe(tmp_path / argv[0])
        writer = threading.Thread(target=lambda path=fifo: path.write_text(text), daemon=True)
        writer.start()
        code, out, err = _run([a.format(fifo) for a in argv], capsys)
        writer.join(timeout=10)
        assert code == 0, err
        assert shown in out, (out, err)


def test_a_target_stops_answering_a_chunk_once_every_trainer_stopped(tmp_path):
    """A target rank regenerating answers finished the whole chunk's decoding (64 prompts of up
    to 160 tokens: tens of seconds on a CPU) after its trainers had stopped, and only then saw
    the stop. It now stops at the next decoding step and computes and sends nothing more."""
    from draftforge.config import load_recipe
    from draftforge.splitserve.producer import (
        SampleSource,
        build_topology,
        load_source_conversations,
    )
    from draftforge.splitserve.target import build_target

    cfg = load_recipe(tiny_recipe(tmp_path, num_conversations=8, overrides={
        "data.regenerate": True, "target.generation.batch_size": 4,
        "target.generation.max_new_tokens": 12, "target.generation.temperature": 0.0}))
    conversations, regenerate = load_source_conversations(cfg)
    assert regenerate
    engine = build_target(cfg.target, cfg.draft.target_layer_ids)
    steps = []  # the model's forward calls: the prefill, then one a decoding step
    engine.model.register_forward_hook(lambda *_: steps.append(1))
    stop_at = 3

    def features(*args, **kwargs):
        raise AssertionError("features computed after the stop")

    source = SampleSource(cfg, engine, build_topology(cfg.split), 0, conversations=conversations,
                          regenerate=regenerate, log=lambda text: None,
                          should_stop=lambda: len(steps) >= stop_at)
    engine.features = features
    assert list(source.samples()) == []
    assert len(steps) == stop_at  # the prefill and two steps; up to 12 without the check
    assert not source._answers  # no chunk's unfinished answers kept


def test_the_stop_advice_says_to_replace_a_train_resume_given_on_the_command_line(tmp_path):
    """'rerun with train.resume=auto', added to a command that set train.resume=never, was refused:
    "train.resume is already set by 'train.resume=never'; give each key once". Where the recipe's
    file sets it, adding the override is what works, and the advice says no more."""
    from test_launch_r11 import _checkpoint as run_checkpoint

    from draftforge.config import load_recipe
    from draftforge.splitserve.launch import _not_auto_advice

    for folder in ("given", "file"):
        (tmp_path / folder).mkdir()
    given = load_recipe(tiny_recipe(tmp_path / "given", steps=8), ["train.resume=never"])
    assert _not_auto_advice(given).endswith(
        "rerun with train.resume=auto in place of 'train.resume=never' to continue from the newest "
        "checkpoint instead.")
    newest = run_checkpoint(tmp_path / "given" / "run", 4)
    assert _not_auto_advice(given).endswith(
        f"rerun with train.resume=auto in place of 'train.resume=never' to continue from {newest}.")
    in_file = load_recipe(tiny_recipe(tmp_path / "file", steps=8, overrides={"train.resume": "never"}))
    assert _not_auto_advice(in_file).endswith(
        "; rerun with train.resume=auto to continue from the newest checkpoint instead.")
