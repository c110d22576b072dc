"""The real executor: loads a Llama-family model and runs StepPlans on a paged KV cache.

Plan semantics are those documented at the top of `protos/step.py`: drops, swap-out,
swap-in, copies, then the sequence deltas, one forward pass over every scheduled token,
and a sample for each sequence whose scheduled tokens reach the end of its known tokens (at
every draft position too, for a sequence verifying drafts: `sampling.draft_verification`).

Under tensor parallelism (`place`) every rank builds its own runner on its share of the model
(`kvserve.executor.tensor_parallel.layout`) and runs every plan; only rank 0 samples.

`ModelRunner` composes the executor's rooms at start-up and runs each step; how many KV blocks it
gets is `kvserve.executor.kv_cache_budget`, and `--compile on`'s decode graphs are captured by
`kvserve.executor.decode_graph_capture`.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import structlog
import torch

from kvserve.config import defaults
from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.attention.registry import create_backend
from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.cpu_features import has_avx512, has_native_bf16
from kvserve.executor.decode_graph_capture import capture_decode_graphs
from kvserve.executor.kv_cache_budget import blocks_for_bytes, device_kv_budget_bytes, kv_bytes_per_block
from kvserve.executor.kv_tier.paged_tier import PagedBlocks, kv_fingerprint, weights_digest
from kvserve.executor.kv_tier.plan_blocks import BlockTiers, start_tier_ops
from kvserve.executor.lora.adapter_set import TENSOR_PARALLEL_REFUSAL, load_adapter_set
from kvserve.executor.lora.adapter_spec import AdapterSpec
from kvserve.executor.lora.step_deltas import LoraStep
from kvserve.executor.model.draft_model import DraftModel, DraftModelSpec, log_loaded
from kvserve.executor.model.input_batch import InputBatch, build_input_batch
from kvserve.executor.model.kv_cache import CacheGeometry, PagedKVCache
from kvserve.executor.model.llama import LlamaModel
from kvserve.executor.model_config import load_model_config
from kvserve.executor.process_memory import MIB, release_freed_heap, resident_bytes
from kvserve.executor.runner_config import (
    NATIVE_WHY,
    RunnerConfig,
    compile_buckets,
    resolve_attention_backend,
    resolve_compile,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_num_threads,
    resolve_weights,
)
from kvserve.executor.sampling.draft_verification import accepted_outputs, position_views
from kvserve.executor.sampling.sampler import sample
from kvserve.executor.sampling.token_mask import plan_token_masks
from kvserve.executor.sequence_state import SequenceState, SequenceTable
from kvserve.executor.tensor_parallel.config import RankPlace, TensorParallelConfig, resolve_backend
from kvserve.executor.tensor_parallel.group import RankLostError, TensorParallelGroup
from kvserve.executor.tensor_parallel.layout import plan_layout
from kvserve.executor.weights import model_store
from kvserve.executor.weights.invariance import fix_model_rows, gemm_padding, probe_cache
from kvserve.executor.weights.loader import load_weights, weight_files
from kvserve.executor.weights.q4_1_linear import Q4_1Linear
from kvserve.kernels import cpu_ops
from kvserve.protos.kv_geometry import GIB
from kvserve.protos.step import ExecutorInfo, SampledToken, StepPlan, StepResult

log = structlog.get_logger(__name__)

TRIM_AFTER_TOKENS = 512
"""A CPU step this large frees tens of MB of activations that glibc would keep resident; trimming
them costs ~30 ms (under 1% of such a step) and keeps RSS near weights + KV (measured: a
2,048-token step left 100–170 MB more resident without it, 0 with it)."""


class ModelRunner:
    """Satisfies `kvserve.executor.protocol.Executor` for real models."""

    def __init__(
        self, config: RunnerConfig, place: RankPlace | None = None, parallel: TensorParallelConfig | None = None
    ) -> None:
        """`place`: this process's rank of a tensor-parallel group (None: the whole model, alone)."""
        self.config = config
        self.device = resolve_device(config, place.local_rank if place is not None else None)
        self.backend_name = resolve_attention_backend(config, self.device)
        # Rows computed alike in every batch: the CPU kernels, fixed GEMM call shapes (weights.invariance).
        self.invariant = config.batch_invariant and self.device == "cpu"
        ranks_on_host = place.local_world_size if place is not None else 1
        if self.device == "cpu":
            torch.set_num_threads(resolve_num_threads(config, ranks_on_host))
        elif self.device.startswith("cuda:"):
            torch.cuda.set_device(self.device)
        started = time.monotonic()
        self.model_dir = model_store.ensure_model_dir(config.model)
        self.model_config = load_model_config(self.model_dir)
        size = place.world_size if place is not None else 1
        self.loras = load_adapter_set(config, self.model_config, self.device, size)  # refused before any load
        self.layout = plan_layout(self.model_config, place.rank if place is not None else 0, size)
        self.group: TensorParallelGroup | None = None
        if place is not None and size > 1:
            parallel = parallel or TensorParallelConfig(tensor_parallel_size=size)
            backend = resolve_backend(parallel, self.device)
            self.group = TensorParallelGroup(place, backend, self.device, parallel.tp_timeout_s)
        self.shard_config = self.layout.shard_config(self.model_config)
        self.max_model_len = self._max_model_len()
        self.vocab_rows = self.layout.vocab_shard if self.layout.sharded else self.model_config.vocab_size
        self.probes = probe_cache() if self.invariant else None
        gguf = model_store.resolve_source(config.model).gguf_file is not None
        self.weights_mode = resolve_weights(config, self.device, size, gguf)
        native = self._native_linears() if self.weights_mode == "native" else None
        if native is None:
            self.weights_mode = "dequantized"  # auto, and the model has no Q4_1 layers to serve
        self.dtype_name, why = self._resolve_dtype()
        self.dtype = getattr(torch, self.dtype_name)
        compiled = resolve_compile(config, self.device, self.weights_mode, self.backend_name, size)
        buckets = compile_buckets(config) if compiled else ()
        if self.invariant or self.backend_name == "cpu" or self.weights_mode == "native":
            ensure_kernels()  # native: the Q8_0 lm_head's kernel
            cpu_ops.set_num_threads(0)  # the kernels' loops on torch's threads...
        self.num_threads = torch.get_num_threads() if self.device == "cpu" else 0
        if self.weights_mode == "native":
            # ...except on the native path: every thread to the kernels, one to torch, whose OpenMP
            # threads would spin on the kernels' cores after each of its own ops (kernels/cpu/work_pool.h).
            self.num_threads = resolve_num_threads(config, ranks_on_host, "native")
            cpu_ops.set_num_threads(self.num_threads)
            torch.set_num_threads(1)
            self.probes = probe_cache() if self.invariant else None  # the probes are per torch thread count
        if "auto" in (config.dtype, config.weights):
            log.info(
                "chose dtype and weights",
                dtype=self.dtype_name,
                weights=self.weights_mode,
                asked=f"--dtype {config.dtype} --weights {config.weights}",
                cpu_native_bf16=has_native_bf16() if self.device == "cpu" else None,
                cpu_avx512=has_avx512() if self.device == "cpu" else None,
                batch_invariant=self.invariant,
                why=why,
            )
        if self.device == "cpu" and not self.invariant:
            log.warning(
                "batch invariance is off: a token's logits may change with what shares its step, how its prompt "
                "was chunked or cached, and across an executor restart",
                attention=self.backend_name,
            )
        weights = load_weights(
            self.model_dir, self.model_config, self.device, self.dtype, native, self.layout, q8_lm_head=bool(native)
        )
        if self.probes is not None:
            fix_model_rows(weights, self.shard_config, self.vocab_rows, self.dtype, config.max_num_seqs, self.probes)
        if self.group is not None:
            self.group.wait_for_all()  # ranks load at their own pace; the compute timeout starts after
        self.model = LlamaModel(
            self.shard_config,
            weights,
            self.max_model_len,
            self.device,
            self.dtype,
            group=self.group,
            silu_mul=cpu_ops.silu_mul if self.invariant else None,
        )
        self.backend = create_backend(self.backend_name)
        self.kv_dtype_name = resolve_kv_cache_dtype(config, self.dtype_name, self.backend_name, self.weights_mode)
        self.geometry = CacheGeometry(
            self.shard_config.num_layers,
            self.shard_config.num_kv_heads,
            self.shard_config.head_dim,
            config.block_size,
            getattr(torch, self.kv_dtype_name),
            layout=self.backend.kv_layout,
        )
        self.draft = self._load_draft() if config.draft_model else None
        per_block = kv_bytes_per_block(self.geometry, self.draft)
        num_blocks = blocks_for_bytes(
            device_kv_budget_bytes(config, self.device, self._peak_activation_bytes), per_block
        )
        num_cpu_blocks = blocks_for_bytes(config.swap_space_gb * GIB, per_block)
        if self.group is not None:  # the scheduler plans one pool for all ranks: the smallest
            num_blocks, num_cpu_blocks = self.group.min_int(num_blocks), self.group.min_int(num_cpu_blocks)
        self.cache = PagedKVCache(self.geometry, num_blocks, num_cpu_blocks, self.device)
        if self.draft is not None:
            self.draft.allocate(num_blocks, num_cpu_blocks)
        self.seqs = SequenceTable()
        self.graphs = (
            capture_decode_graphs(
                self.model, self.cache, self.backend, buckets, config, self.device, self.max_model_len
            )
            if compiled
            else None
        )
        self.model_id = self._model_id()
        self.kv_fingerprint = ""
        """What this cache's bits depend on (`paged_tier.kv_fingerprint`), with tiers below the pool; else ""."""
        self.tiers = self._block_tiers()
        self.tier_blocks = PagedBlocks(self.cache)
        release_freed_heap()
        log.info(
            "model runner ready",
            model_id=self.model_id,
            device=self.device,
            dtype=self.dtype_name,
            kv_cache_dtype=self.kv_dtype_name,
            weights=self.weights_mode,
            attention=self.backend_name,
            num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            threads=self.num_threads or None,
            compiled_buckets=",".join(map(str, buckets)) or None,
            tensor_parallel=f"rank {self.layout.rank} of {size}" if size > 1 else None,
            rss_mib=round(resident_bytes() / MIB),
            seconds=round(time.monotonic() - started, 2),
        )

    # --- Executor protocol -------------------------------------------------------

    def info(self) -> ExecutorInfo:
        cfg = self.model_config
        return ExecutorInfo(
            model_id=self.model_id,
            num_blocks=self.cache.num_blocks,
            block_size=self.config.block_size,
            num_cpu_blocks=self.cache.num_cpu_blocks,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids),
            tokenizer_path=str(self.model_dir),
            executor_kind="torch",
            device=self.device,
            dtype=self.dtype_name,
            attention_backend=self.backend_name,
            num_threads=self.num_threads,
            draft_model_id=self.draft.model_id if self.draft is not None else "",
            lora_names=list(self.loras.names),
            kv_fingerprint=self.kv_fingerprint,
            kv_disk_keys=self.tiers.keys() if self.tiers is not None else [],
            kv_block_bytes=self.cache.geometry.bytes_per_block,
            kv_tiers=self.tiers.media() if self.tiers is not None else [],
        )

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self.loras.check_plan(plan.new_seqs)
        # Loads fill fresh blocks beside the forward pass (nothing in this step reads them).
        finish_tier_ops = start_tier_ops(plan, self.tiers, self.tier_blocks)
        try:
            outputs, proposals = self._run_step(plan)
        finally:
            tier_ops = finish_tier_ops()
        return StepResult(
            step_id=plan.step_id,
            outputs=outputs,
            execute_time_s=time.perf_counter() - started,
            proposals=proposals,
            failed_load_blocks=tier_ops.failed,
            disk_load_blocks=tier_ops.from_disk,
            dropped_keys=tier_ops.dropped,
        )

    def _run_step(self, plan: StepPlan) -> tuple[list[SampledToken], list[tuple[int, list[int]]]]:
        """The plan's block ops and forward pass: the sampled tokens and the draft model's proposals."""
        self.seqs.drop(plan.drop_seq_ids)
        self.seqs.trim(plan.trims)
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        self.cache.copy_blocks(plan.copies)
        if self.draft is not None:
            self.draft.block_ops(plan.copies, plan.swap_out, plan.swap_in)
        scheduled: list[SequenceState] = []
        for new in plan.new_seqs:
            state = self.seqs.add(new)
            if state.num_scheduled_tokens > 0:
                scheduled.append(state)
        for cached in plan.known_seqs:
            state = self.seqs.update(cached)
            if state.num_scheduled_tokens > 0:
                scheduled.append(state)
        outputs: list[SampledToken] = []
        proposals: list[tuple[int, list[int]]] = []
        if scheduled:
            with torch.inference_mode():
                batch = build_input_batch(
                    scheduled,
                    self.config.block_size,
                    self.device,
                    self.model.scale,
                    self.dtype,
                    self.shard_config.num_kv_heads,
                    self.loras.indices,
                )
                logits = self._forward(batch, self.loras.step(batch.lora_indices))
                if logits is not None:  # None: a tensor-parallel rank other than 0, which does not sample
                    sampling, counts = batch.sampling_seqs, batch.sample_counts
                    rows = sampling if counts is None else position_views(sampling, counts)
                    masks = plan_token_masks(plan, [s.seq_id for s in rows], logits.shape[1], logits.device)
                    outputs = sample(logits, rows, self.model_config.eos_token_ids, masks)
                    if counts is not None:
                        outputs = accepted_outputs(sampling, counts, outputs)
                if self.draft is not None:
                    self.draft.catch_up(scheduled, self.backend)
                    if plan.draft_requests:
                        proposals = self.draft.propose(scheduled, outputs, plan.draft_requests, self.backend)
            if self.device == "cpu" and batch.num_tokens >= TRIM_AFTER_TOKENS:
                release_freed_heap()
        return outputs, proposals

    def reset(self) -> None:
        self.seqs.clear()

    def load_adapter(self, name: str, path: str) -> list[str]:
        if self.group is not None:
            raise ExecutorConfigError(TENSOR_PARALLEL_REFUSAL)
        self.loras = self.loras.adding(AdapterSpec(name, Path(path)), self.model_config, self.config.max_lora_rank)
        return list(self.loras.names)

    def unload_adapter(self, name: str) -> list[str]:
        self.loras = self.loras.removing(name)
        return list(self.loras.names)

    def _forward(self, batch: InputBatch, lora: LoraStep | None = None) -> torch.Tensor | None:
        """The forward pass, with `lora`'s deltas (a step with LoRA rows runs eagerly: the decode graphs
        hold none). Sharded, a failure inside it (out of memory, say) can leave another rank waiting in a
        collective this rank never reaches, so it ends the group instead of the step."""
        if self.group is None:
            logits = self.graphs.forward(batch) if self.graphs is not None and lora is None else None
            return logits if logits is not None else self.model.forward(batch, self.cache, self.backend, lora)
        try:
            return self.model.forward(batch, self.cache, self.backend)
        except RankLostError:
            raise
        except Exception as exc:
            raise RankLostError(f"the forward pass failed on rank {self.group.rank}: {exc!r}") from exc

    def close(self) -> None:
        self.seqs.clear()
        if self.tiers is not None:
            self.tiers.close()  # the writes queued so far reach the disk
            self.tiers = None
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.graphs = None  # a CUDA graph's memory pool is freed with it
        self.cache = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # --- start-up ----------------------------------------------------------------

    def _block_tiers(self) -> BlockTiers | None:
        """The prefix cache's tiers below the pool (--kv-host-gb, --kv-disk-dir), keyed by what this
        cache's bits depend on; None without either."""
        config = self.config
        if not BlockTiers.asked_for(config.kv_host_gb, config.kv_disk_dir):
            return None
        if self.group is not None:
            raise ExecutorConfigError(
                "--kv-host-gb and --kv-disk-dir run on one executor: not with tensor parallelism yet"
            )
        if self.draft is not None:
            raise ExecutorConfigError(
                "--kv-host-gb and --kv-disk-dir with --draft-model: the draft model's KV is not in the tiers yet"
            )
        weights = weights_digest(weight_files(self.model_dir))
        self.kv_fingerprint = kv_fingerprint(weights, self.cache, self.dtype_name, self.weights_mode, self.device)
        queue = max(1, defaults.KV_DISK_WRITE_QUEUE_BYTES // self.cache.geometry.bytes_per_block)
        tiers = BlockTiers.open(
            config.kv_host_gb, config.kv_disk_dir, config.kv_disk_gb, self.kv_fingerprint, queue_blocks=queue
        )
        disk = tiers.disk
        log.info(
            "kv tiers below the pool",
            host_gb=config.kv_host_gb or None,
            directory=config.kv_disk_dir,
            disk_blocks=len(disk.keys()) if disk is not None else None,
            disk_capacity_gb=config.kv_disk_gb if disk is not None else None,
            disk_writable=disk.writable if disk is not None else None,
        )
        return tiers

    def _resolve_dtype(self) -> tuple[str, str]:
        """The dtype, and why `auto` chose it: the fastest that passes the quality bar on this device
        (docs/benchmarks.md) and, by default, computes every row alike in every batch."""
        dtype = resolve_dtype(self.config, self.device, self.weights_mode)
        if self.config.dtype != "auto":
            return dtype, "asked for"
        if self.weights_mode == "native" and self.config.weights == "auto":
            return dtype, NATIVE_WHY
        why = "the fastest that passes the quality bar on this device (docs/benchmarks.md)"
        if dtype != "bfloat16" or self.probes is None:
            return dtype, why
        padding = gemm_padding(
            self.shard_config, self.vocab_rows, torch.bfloat16, self.config.max_num_seqs, self.probes
        )
        cost = f"{padding.min_rows} rows up ({padding.shape}; padding costs {padding.float32_rows:.0f} float32 rows)"
        if padding.affordable:
            return dtype, f"{why}; its GEMMs are batch-invariant from {cost}"
        return "float32", (
            f"bfloat16 GEMMs are batch-invariant on this CPU only from {cost}, too costly to pad a decode "
            "step to: float32 instead"
        )

    def _max_model_len(self) -> int:
        cfg = self.model_config
        limit = self.config.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < limit:
            # Sliding-window attention is not implemented; within the window it equals full attention.
            log.warning("capping max_model_len to the sliding window", sliding_window=cfg.sliding_window)
            limit = cfg.sliding_window
        return limit

    def _load_draft(self) -> DraftModel:
        """The draft model for `--speculative draft`, on this device in this dtype, its KV like the model's."""
        assert self.config.draft_model is not None
        if self.group is not None:
            raise ExecutorConfigError(
                "--draft-model runs on one executor: it cannot be combined with tensor parallelism"
            )
        spec = DraftModelSpec(
            source=self.config.draft_model,
            weights=self.weights_mode,
            vocab_size=self.model_config.vocab_size,
            block_size=self.config.block_size,
            kv_dtype=self.geometry.dtype,
            kv_layout=self.geometry.layout,
            max_model_len=self.max_model_len,
        )
        draft = DraftModel(spec, self.device, self.dtype, silu_mul=self.model.silu_mul)
        log_loaded(draft)
        return draft

    def _peak_activation_bytes(self) -> int:
        """The CUDA profiling forward at the largest batch (run only when CUDA's KV budget is measured)."""
        from kvserve.executor.model.profiling_batch import profile_peak_activation_bytes

        return profile_peak_activation_bytes(self)

    def _native_linears(self) -> list[dict[str, Q4_1Linear]] | None:
        """The GGUF's Q4_1 layers (this rank's share); None where `--weights auto` chose native but the
        model has none to serve."""
        from kvserve.executor.weights.gguf_weights import native_linears_or_none  # reads `gguf` lazily

        required = self.config.weights == "native"
        return native_linears_or_none(self.config.model, self.model_config, self.layout, required=required)

    def _model_id(self) -> str:
        source = model_store.resolve_source(self.config.model)
        digest = hashlib.sha256((self.model_dir / "config.json").read_bytes())
        for path in weight_files(self.model_dir):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
        # Native 4-bit weights compute other KV than the dequantized ones: never share a prefix cache.
        native = "+q4_1" if self.weights_mode == "native" else ""
        return f"{source.name}@{digest.hexdigest()[:12]}{native}"
