"""Shared pytest setup: offline libraries and a bounded number of torch threads."""

import os

# Nothing in the suite may reach a model hub or a tracking server.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402  (after the environment above)

# Deterministic, small thread counts: tests that start several processes
# must not oversubscribe the cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))
