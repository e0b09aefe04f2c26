"""Round 43: the objective's cached ``[lm_head, W2]`` matrix on CPU.

1. The copy of the frozen lm_head's columns was reused while the tensor object and its
   in-place version stayed the same; ``param.data = other`` (how a frozen weight is swapped
   without autograd) keeps both, so the objective would have gone on scoring with the old
   lm_head. The storage address is now part of the key.
"""

from __future__ import annotations

import torch

from draftforge.train.objective import _vocab_head


def test_a_lm_head_whose_data_is_replaced_is_not_served_from_the_stale_copy():
    torch.manual_seed(0)
    lm_head = torch.nn.Parameter(torch.randn(12, 4), requires_grad=False)
    w2 = torch.randn(12, 3)
    first = _vocab_head(lm_head, w2).clone()
    assert torch.equal(first, torch.cat([lm_head, w2], dim=1))
    version = lm_head._version
    lm_head.data = torch.randn(12, 4)  # same object, same version, other values
    assert lm_head._version == version
    assert torch.equal(_vocab_head(lm_head, w2), torch.cat([lm_head, w2], dim=1))
