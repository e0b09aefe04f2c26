"""Session 56: the target rank's end-of-run counts of conversations its tokenisation cut or
dropped describe the data, not how many epochs happened to tokenise it."""

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
