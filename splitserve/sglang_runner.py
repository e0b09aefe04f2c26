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

The runner lives in spawned child processes (``FeatureRunnerProcess``): SGLang
builds its own ``torch.distributed`` world and process-wide state, which must
not meet a draftforge rank's. States come back through a ``torch.multiprocessing``
pipe (shared memory on CPU, CUDA IPC on GPU); token ids go in as numpy arrays, pickled
by value. Sent as CPU tensors, each row's storage was a file descriptor that the
parent's multiprocessing ``resource_sharer`` thread served until the child fetched it:
a child stopped during that fetch (``close(force=True)`` stopping the other ranks after
one failed) made the thread print a ``ConnectionResetError`` traceback.

Under tensor parallelism (``tp_size`` > 1 in the server arguments) there is one
child per tensor-parallel rank, on GPUs ``base_gpu_id`` .. ``base_gpu_id +
tp_size - 1`` (SGLang's own placement), joined into SGLang's world on the
``nccl_port`` the parent chose. Every child runs the same prefill in lockstep
(the layers all-reduce between them); the residual stream, and so every
captured state, is whole on each rank after those all-reduces, so only rank 0
sends its states back and the others answer with ``None``.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as tmp

from draftforge.splitserve.sglang_backend import SGLANG_VERSION, require_sglang

# How long a stop waits for the tensor-parallel processes to finish their batch and return
# (together), before they get SIGTERM and, 10 s later, SIGKILL; the launcher's SIGKILL comes
# supervisor.SGLANG_TERM_S (45 s) after its SIGTERM.
STOP_WAIT_S = 30.0


class FeatureRunner:
    """An SGLang ``ModelRunner`` with auxiliary-state capture, in this process (call it in a fresh one)."""

    def __init__(self, server_args: dict[str, Any], *, tp_rank: int = 0) -> None:
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
        gpu_id = int(server_args.get("base_gpu_id", 0)) + tp_rank  # SGLang's placement, step 1
        publish(
            args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(args, tp_rank=tp_rank, pp_rank=0), gpu_id=gpu_id
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
                f"{self.max_total_tokens} tokens; lower split.feature_batch_size (rows per batch) "
                "or data.max_length"
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


def free_port(low: int = 22000, high: int = 29999) -> int:
    """A loopback port free now, for SGLang's world of tensor-parallel children to meet on:
    one of ``low..high`` below the kernel's ephemeral range (which outgoing connections draw
    from), else, where that range starts at ``low`` or below (``1024 65535``), one the
    kernel picks."""
    high = min(high, _ephemeral_low() - 1)
    ports = list(range(low, high + 1))
    start = os.getpid() % len(ports) if ports else 0  # runners starting together probe apart
    for port in ports[start:] + ports[:start] or [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise RuntimeError(f"no free loopback port in {low}..{high} for the SGLang feature runner")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _serve(
    conn: Any, server_args: dict[str, Any], num_threads: int, tp_rank: int, runner_cls: type
) -> None:
    """Child process of tensor-parallel rank ``tp_rank``: build the runner, then answer
    ``("features", rows)`` (states on rank 0, ``None`` on the others) until ``("stop",)``."""
    torch.set_num_threads(num_threads)
    if server_args.get("device") == "cpu":
        # SGLang picks its CPU kernels only under this switch, read once at import
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        runner = runner_cls(server_args, tp_rank=tp_rank)
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
            states = runner.features([torch.from_numpy(row) for row in message[1]])
            conn.send(("ok", states if tp_rank == 0 else None))
        except Exception:  # reported to the parent, which raises
            conn.send(("error", traceback.format_exc()))


class FeatureRunnerProcess:
    """The parent's handle on a ``FeatureRunner`` in spawned child processes, one per
    tensor-parallel rank (``server_args["tp_size"]``, default 1).

    A child that fails or exits stops them all, with its traceback in the error: the
    others may be waiting in a collective for it and would never answer.
    ``runner_cls`` replaces ``FeatureRunner`` in tests (a module-level class).
    """

    def __init__(
        self,
        server_args: dict[str, Any],
        *,
        num_threads: int = 1,
        runner_cls: type = FeatureRunner,
    ) -> None:
        self.tp_size = int(server_args.get("tp_size", 1))
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {self.tp_size}")
        args = dict(server_args)
        if self.tp_size > 1 and args.get("nccl_port") is None:
            args["nccl_port"] = free_port()  # one meeting point for every rank's world
        context = tmp.get_context("spawn")
        self._conns: list[Any] = []
        self._processes: list[Any] = []
        for tp_rank in range(self.tp_size):
            conn, child = context.Pipe()
            process = context.Process(
                target=_serve, args=(child, args, num_threads, tp_rank, runner_cls), daemon=True
            )
            process.start()
            child.close()
            self._conns.append(conn)
            self._processes.append(process)
        try:
            replies = self._gather("starting")
        except RuntimeError:
            self.close(force=True)
            raise
        self.max_total_tokens = min(int(payload) for payload in replies)

    def features(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed aux ``[T, K*H]`` and final ``[T, H]`` states for ``rows``, computed in the children."""
        if not self._conns:
            raise RuntimeError("the SGLang feature runner was stopped (close() or a failure)")
        # by value, not as shared tensors: nothing for the children to fetch (module docstring)
        arrays = [row.cpu().numpy() for row in rows]
        for conn in self._conns:
            try:
                conn.send(("features", arrays))
            except (BrokenPipeError, OSError):
                pass  # that child is gone: _gather reports how it ended
        try:
            return self._gather("computing features")[0]
        except RuntimeError:
            self.close(force=True)
            raise

    def close(self, *, force: bool = False) -> None:
        """Stop the child processes: asked to, or at once with ``force`` (after a failure,
        when the others may be stuck in a collective with the one that failed). One still
        alive 10 s after SIGTERM is killed: waiting in a collective, a child never runs a
        Python handler it installed for the signal. A stop waits ``STOP_WAIT_S`` for all of them
        together, so a close takes at most that plus 10 s (the launcher's SIGKILL comes 45 s
        after its SIGTERM with an SGLang target)."""
        if not force:
            for conn, process in zip(self._conns, self._processes, strict=True):
                if process.is_alive():
                    try:
                        conn.send(("stop",))
                    except (BrokenPipeError, OSError):
                        pass
            deadline = time.monotonic() + STOP_WAIT_S  # one wait for them all, not 30 s each
            for process in self._processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        for conn in self._conns:
            conn.close()  # an idle child reads the end of its pipe and returns
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 10
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self._conns, self._processes = [], []

    def _gather(self, phase: str) -> list[Any]:
        """Every child's answer, in rank order; the first failure or exit raises at once."""
        expected = "ready" if phase == "starting" else "ok"
        answers: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while waiting:
            for ready in wait([*waiting, *sentinels]):
                if ready in sentinels:
                    rank = sentinels.pop(ready)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():  # gone without a word
                        raise RuntimeError(self._failure(rank, phase))
                    continue
                rank = waiting.pop(ready)
                try:
                    kind, payload = ready.recv()
                except EOFError:
                    raise RuntimeError(self._failure(rank, phase)) from None
                if kind != expected:
                    raise RuntimeError(self._failure(rank, phase, payload))
                answers[rank] = payload
        return [answers[rank] for rank in range(len(self._conns))]

    def _failure(self, rank: int, phase: str, error: str | None = None) -> str:
        """What went wrong in child ``rank``: its traceback, or that it exited without one."""
        where = f" (tensor-parallel rank {rank} of {self.tp_size})" if self.tp_size > 1 else ""
        if error is None:
            self._processes[rank].join(timeout=10)  # its pipe may close before it is reaped
            code = self._processes[rank].exitcode
            return f"the SGLang feature runner{where} exited (exit code {code}) while {phase}"
        return f"the SGLang feature runner{where} failed while {phase}:\n{error}"
