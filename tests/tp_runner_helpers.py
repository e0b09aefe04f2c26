"""A stand-in for SGLang's feature runner under tensor parallelism, for ``FeatureRunnerProcess``.

Each tensor-parallel rank holds a shard of the hidden dimension of two weight matrices and
all-reduces its partial products over gloo, as SGLang's row-parallel layers do over NCCL: only
ranks that received the same token ids and met on the same port return the whole product.
Spawned children import it by name, so it lives in a module of its own.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

VOCAB, HIDDEN, AUX, FINAL = 50, 12, 6, 4


def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(HIDDEN, AUX, generator=gen),
            torch.randn(HIDDEN, FINAL, generator=gen))


def reference(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What one process computes with the whole matrices."""
    table, w_aux, w_final = weights()
    hidden = table[torch.cat(rows)]
    return hidden @ w_aux, hidden @ w_final


class GlooShardedRunner:
    """``FeatureRunner``'s interface: ``max_total_tokens`` and ``features(rows)``.

    ``server_args["fail"] = [phase, rank]`` makes that rank fail: ``"start-exit"`` exits
    during start-up, ``"features"`` raises while computing.
    """

    def __init__(self, server_args: dict, *, tp_rank: int = 0) -> None:
        self.tp_rank, self.tp_size = tp_rank, int(server_args["tp_size"])
        self.fail = server_args.get("fail") or [None, None]
        if self.fail == ["start-exit", tp_rank]:
            os._exit(5)
        if self.tp_size > 1:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{server_args['nccl_port']}",
                rank=tp_rank, world_size=self.tp_size, timeout=datetime.timedelta(seconds=120),
            )
        self.max_total_tokens = 1000 + 10 * tp_rank
        table, w_aux, w_final = weights()
        shard = slice(tp_rank, HIDDEN, self.tp_size)
        self.table, self.w_aux, self.w_final = table[:, shard], w_aux[shard], w_final[shard]

    def features(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail == ["features", self.tp_rank]:
            raise ValueError(f"boom on tensor-parallel rank {self.tp_rank}")
        hidden = self.table[torch.cat(rows)]
        aux, final = hidden @ self.w_aux, hidden @ self.w_final
        if self.tp_size > 1:
            dist.all_reduce(aux)
            dist.all_reduce(final)
        return aux, final
