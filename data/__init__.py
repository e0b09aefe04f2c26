"""draftforge.data: data files -> prompts, conversations and token / loss-mask samples.

formats (row validation), loading (files, builtin:train-prompts), tokenize (chat template
-> ids + loss mask), regenerate (the target answers the prompts), prompts (the generated
training prompt set), workloads (evaluation prompts from PyPI packages), overlap (training
vs evaluation contamination check). No torch.distributed and no model code here.
"""
