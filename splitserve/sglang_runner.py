"""SGLang 0.5.23 internals, confined here: a ``ModelRunner`` that returns captured states as tensors.

SGLang's public engine returns hidden states only as nested Python float lists
(``batch_result_processor._append_prefill_hidden_states`` calls ``.tolist()``).
Its in-process ``LogitsProcessorOutput`` keeps them as device tensors: under
``--enable-return-aux-hidden-states`` and full capture, ``hidden_states`` holds
the auxiliary layers packed ``[T, K*H]`` (ascending layers) and
``last_hidden_states`` the post-norm final state ``[T, H]``, ``T`` being the
batch's tokens concatenated request after request. This module drives that
path the way SGLang's own ``benchmark/one_batch.py`` does (publish the
runtime context, build the ``ModelRunner``, one ``ScheduleBatch`` prefill per
call). All of it is internal API of SGLang 0.5.23: ``FeatureRunner`` refuses
any other version, and a new release must pass the GPU parity test in
``tests/test_sglang_backend.py`` before the pin moves.

The runner lives in a spawned child process (``FeatureRunnerProcess``): SGLang
builds its own ``torch.distributed`` world and process-wide state, which must
not meet a draftforge rank's. Token ids go in and states come back through a
``torch.multiprocessing`` pipe (shared memory on CPU, CUDA IPC on GPU).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.multiprocessing as tmp

from draftforge.splitserve.sglang_backend import SGLANG_VERSION, require_sglang


class FeatureRunner:
    """An SGLang ``ModelRunner`` with auxiliary-state capture, in this process (call it in a fresh one)."""

    def __init__(self, server_args: dict[str, Any]) -> None:
        require_sglang()
        from sglang.srt.arg_groups.model_override_base import resolving_view
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
        from sglang.srt.server_args import PortArgs, ServerArgs

        args = ServerArgs(**server_args)
        args.resolve_once()
        _set_envs_and_config(args)
        port_args = PortArgs.init_new(args)
        gpu_id = int(server_args.get("base_gpu_id", 0))
        publish(
            args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(args, tp_rank=0, pp_rank=0), gpu_id=gpu_id
            ),
        )
        for initialize in (
            initialize_moe_config,
            initialize_fp8_gemm_config,
            initialize_bf16_gemm_config,
            initialize_fp4_gemm_config,
        ):
            initialize()  # process-wide kernel choices the scheduler would set up
        model_config = ModelConfig.from_server_args(args)
        bootstrap.init_parallel_runtime(
            server_args=args, device=get_device().device, dist_port=port_args.nccl_port
        )
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(
            model_config=model_config,
            # resolved values live in declarations over the raw record: read them through the view
            mem_fraction_static=resolving_view(args).mem_fraction_static,
            gpu_id=gpu_id,
            nccl_port=port_args.nccl_port,
            server_args=args,
        )
        runner.alloc_memory_pool()
        runner.init_attention_backends()
        runner.init_cuda_graphs()
        self.runner = runner
        self.max_total_tokens = int(runner.max_total_num_tokens)

    @torch.no_grad()
    def features(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill over ``rows`` (1-D token ids); returns aux ``[T, K*H]`` and final ``[T, H]``."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        total = sum(len(row) for row in rows)
        if total > self.max_total_tokens:
            raise ValueError(
                f"a features batch of {total} tokens exceeds the SGLang runner's KV pool of "
                f"{self.max_total_tokens} tokens; send smaller batches"
            )
        runner = self.runner
        reqs = []
        for index, row in enumerate(rows):
            req = Req(
                rid=str(index),
                origin_input_text="",
                origin_input_ids=array("q", row.tolist()),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
                return_hidden_states=True,
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = len(req.origin_input_ids)
            reqs.append(req)
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=_NoPrefixCache(
                page_size=get_schedule().page_size,
                device=runner.device,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            ),
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        try:
            batch.prepare_for_extend()
            if (
                batch.input_ids is None
                and getattr(batch, "prefill_input_ids_cpu", None) is not None
            ):
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)
                batch.prefill_input_ids_cpu = None
            forward_batch = ForwardBatch.init_new(
                batch,
                runner,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                return_hidden_states_before_norm=False,
            )
            output = runner.forward(forward_batch).logits_output
            aux, final = output.hidden_states, output.last_hidden_states
            if aux is None or final is None:
                raise RuntimeError(
                    f"SGLang {SGLANG_VERSION} returned no captured states (aux "
                    f"{aux is not None}, final {final is not None}); is aux capture enabled?"
                )
            return aux.clone(), final.clone()
        finally:
            # Nothing is cached between calls: every call is a fresh prefill.
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()


class _NoPrefixCache:
    """The tree-cache interface ``ScheduleBatch`` asks of a prefill that shares and keeps nothing."""

    def __init__(self, *, page_size: int, device: Any, token_to_kv_pool_allocator: Any) -> None:
        self.page_size = page_size
        self.device = device
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        # as SGLang's one-batch benchmark answers: keeps prepare_for_extend off its
        # sliding-window eviction branch, which a cache-less prefill never needs
        return True

    def evict(self, params: Any) -> None:
        """Nothing is cached, so nothing to evict."""

    def maybe_hand_to_session(self, req: Any) -> None:
        """No sessions."""


def _serve(conn: Any, server_args: dict[str, Any], num_threads: int) -> None:
    """Child process: build the runner, then answer ``("features", rows)`` until ``("stop",)``."""
    torch.set_num_threads(num_threads)
    if server_args.get("device") == "cpu":
        # SGLang picks its CPU kernels only under this switch, read once at import
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        runner = FeatureRunner(server_args)
    except BaseException:  # reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", runner.max_total_tokens))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "stop":
            return
        try:
            conn.send(("ok", runner.features(message[1])))
        except Exception:  # reported to the parent, which raises
            conn.send(("error", traceback.format_exc()))


class FeatureRunnerProcess:
    """The parent's handle on a ``FeatureRunner`` in a spawned child process."""

    def __init__(self, server_args: dict[str, Any], *, num_threads: int = 1) -> None:
        context = tmp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, server_args, num_threads), daemon=True
        )
        self._process.start()
        child.close()
        kind, payload = self._receive()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the SGLang feature runner failed to start:\n{payload}")
        self.max_total_tokens = int(payload)

    def features(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed aux ``[T, K*H]`` and final ``[T, H]`` states for ``rows``, computed in the child."""
        self._conn.send(("features", rows))
        kind, payload = self._receive()
        if kind != "ok":
            raise RuntimeError(f"the SGLang feature runner failed:\n{payload}")
        return payload

    def close(self) -> None:
        """Stop the child process."""
        if self._process.is_alive():
            try:
                self._conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()
        self._conn.close()

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(
                f"the SGLang feature runner exited (exit code {self._process.exitcode})"
            ) from exc
