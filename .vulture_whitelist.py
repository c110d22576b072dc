# ruff: noqa: B018
"""Names vulture cannot see used: entry points that a framework, a protocol or the tests reach.

`make lint` runs vulture over the product's folders (`[tool.vulture]` in pyproject.toml) with this
file beside them; a name listed here counts as used wherever it is defined, so list only a real
entry point, each with who reaches it. A definition nothing reaches is dead: delete it instead.
The tests (tests/) are not scanned, so what only they call is listed in the last section.
Each entry is an attribute access that vulture reads as a use (hence ruff's B018 is off here).
"""

from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# --- HTTP routes: FastAPI calls each handler its decorator registered --------------------------------
_.chat_completions  # scheduler_svc/.../http/openai_routes.py: POST /v1/chat/completions
_.get_load  # scheduler_svc/.../http/service_routes.py: GET /get_load (vllm-router's load probe)
_.tokenize  # http/service_routes.py: POST /tokenize; also the clients' public Client.tokenize/AsyncClient.tokenize
_.detokenize  # scheduler_svc/.../http/service_routes.py: POST /detokenize
_.page  # scheduler_svc/.../http/ui_routes.py: GET / (the web page)
_.load_lora_adapter  # scheduler_svc/.../http/lora_routes.py: POST /v1/load_lora_adapter
_.unload_lora_adapter  # scheduler_svc/.../http/lora_routes.py: POST /v1/unload_lora_adapter

# --- gRPC: grpc calls the KVServe servicer's methods by the RPC's name, and an interceptor's hook -----
_.Abort  # grpc_api/api_server.py: rpc Abort (protos/kvserve/v1/api.proto)
_.Tokenize  # grpc_api/api_server.py: rpc Tokenize
_.ModelInfo  # grpc_api/api_server.py: rpc ModelInfo
_.LoadLoraAdapter  # grpc_api/api_server.py: rpc LoadLoraAdapter
_.UnloadLoraAdapter  # grpc_api/api_server.py: rpc UnloadLoraAdapter
_.intercept_service  # security/auth.py: grpc.aio.ServerInterceptor's hook, called by grpc for every call

# --- uvicorn: what it calls on, and reads from, the Server subclass the HTTP API embeds ----------------
_.capture_signals  # http/http_server.py: overrides uvicorn.Server.capture_signals (no signal handlers)
_.should_exit  # http/http_server.py: uvicorn.Server reads it to begin a graceful shutdown
_.force_exit  # http/http_server.py: uvicorn.Server reads it to stop waiting for connections

# --- ZeroMQ: a socket option set as an attribute is a setsockopt --------------------------------------
_.curve_secretkey  # link_worker.py and link_socket.py: zmq.CURVE_SECRETKEY
_.curve_publickey  # link_worker.py and link_socket.py: zmq.CURVE_PUBLICKEY
_.curve_serverkey  # executor_svc/.../link_worker.py: zmq.CURVE_SERVERKEY (the executor pins the scheduler)
_.curve_server  # scheduler_svc/.../executor_link/link_socket.py: zmq.CURVE_SERVER

# --- torch and transformers ---------------------------------------------------------------------------
_._shape  # executor/model/opaque_norm.py: @opaque_rms_norm.register_fake, torch's fake-tensor shape function
_.hf_quantizer  # executor/weights/model_store.py: transformers' save_pretrained reads it (set None to save)

# --- import-linter: loads the contract type named in pyproject.toml and calls its hooks ---------------
_.AllowlistContract  # kvserve/testing/import_contracts.py: contract_types = ["allowlist: ..."]
_.render_broken_contract  # kvserve/testing/import_contracts.py: importlinter.Contract's report hook

# --- fields read by name: msgspec encodes a Struct's fields; asdict() writes a dataclass's to JSON ------
_.parent_block_hash  # protos/kv_events.py: BlockStored, on the wire to vllm-router (--kv-events-endpoint)
_.lora_id  # protos/kv_events.py: BlockStored, on the wire (vLLM's event schema)
_.lora_name  # protos/kv_events.py: BlockStored, on the wire (vLLM's event schema)
_.ts  # protos/kv_events.py: KVEventBatch's timestamp, on the wire
_.data_parallel_rank  # protos/kv_events.py: KVEventBatch, on the wire
_.p50  # kvserve/bench/latency_stats.py: LatencySummary.to_dict() (asdict) into the bench reports
_.p90  # kvserve/bench/latency_stats.py: LatencySummary.to_dict()
_.p99  # kvserve/bench/latency_stats.py: LatencySummary.to_dict()
_.direct_ttft_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict() into the --json report
_.routed_ttft_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict()
_.added_ttft_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict()
_.direct_e2e_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict()
_.routed_e2e_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict()
_.added_e2e_ms  # kvserve/bench/scale_out.py: RouterLatency, asdict()
_.timed_steps  # kvserve/bench/structured.py: StructuredBenchResult, asdict() into --json

# --- called only from tests/: the test support (kvserve/testing), references and inspection hooks -----
_.serve_in_process  # kvserve/testing/in_process_serving.py: tests/services/test_speculation_real_model.py
_.preempt  # kvserve/testing/plan_driver.py: tests/link/test_fake_executor.py
_.free_port  # kvserve/testing/ports.py: tests/reliability/*, scripts/llama_server.sh
_.metric_total  # kvserve/testing/replica_launcher.py: tests/services/test_router.py, tests/reliability/
_.replica_pids  # kvserve/testing/replica_launcher.py: tests/reliability/test_data_parallel_serve.py
_.checked_configs  # kvserve/testing/scheduler_config.py: tests/scheduler/*
_.wait_health  # kvserve/testing/server_launcher.py: tests/reliability/*
_.kill_executor  # kvserve/testing/server_launcher.py: the disk tier's and runtime LoRA's kill -9 tests
_.SHARDABLE  # kvserve/testing/tiny_checkpoints.py: tests/executor/test_tensor_parallel_layout.py, tests/reliability/
_.CASES  # kvserve/testing/tiny_checkpoints.py: tests/executor/test_tiny_models.py
_.tiny_checkpoint  # kvserve/testing/tiny_checkpoints.py: tests/executor/test_tiny_models.py, test_speculation_cuda.py
_.write_tiny_checkpoint  # kvserve/testing/tiny_checkpoints.py: tests/executor/*, tests/reliability/
_.store_kv_reference  # kernels/reference.py: the kernels' torch reference, tests/kernels/test_kernels*.py
_.paged_attention_reference  # kernels/reference.py: tests/kernels/test_kernels*.py
_.q8_linear_reference  # kernels/reference.py: tests/kernels/test_cpu_ops.py
_.q4_1_linear_reference  # kernels/reference.py: tests/kernels/test_cpu_ops.py, tests/executor/test_gguf_q4_1.py
_.lora_add_reference  # kernels/reference.py: tests/kernels/test_lora_add.py
_.head_major  # kernels/cpu_ops.py: the head-major cache layout, tests/kernels/test_cpu_ops.py and others
_.expected_completion  # executor/fake/tokens.py: what the fake executor must produce, tests/scheduler/*
_.shadow_tokens  # executor/fake/executor.py: inspection, tests/link/test_fake_executor.py
_.ref_count  # scheduler/core/scheduler.py: inspection, tests/scheduler/test_scheduler_core.py and others
_.debug_dump  # scheduler/core/scheduler.py: the tables in assertion messages, tests/scheduler/*
_.cpu_blocks_used  # scheduler/core/outputs.py: SchedulerStats, tests/scheduler/test_abort.py and others
_.active_requests  # scheduler/server/engine_status.py: EngineStats, tests/services/test_engine.py
_.cached_hashes  # observability/kv_event_recorder.py: inspection, tests/services/test_kv_events.py
_.scrape  # observability/metrics.py: the exposition text, tests/bench/test_metrics.py
_.tenants  # security/auth.py: the token table's tenants, tests/reliability/test_auth_unit.py
_.LATENCY_KEYS  # kvserve/bench/report.py: the report's latency keys, tests/bench/test_bench_serve_e2e.py
_.JSON_KEYS  # kvserve/commands/kv_plan.py: `kvserve kv-plan --json`'s keys, tests/scheduler/test_kv_plan.py

# --- the GPU check: checks named by "module:function" strings in kvserve/gpu_check/stages.py ----------
_.check_environment  # gpu_check/environment.py
_.measure_device_peaks  # gpu_check/measure.py
_.check_kv_sizing  # gpu_check/measure.py
_.measure_decode  # gpu_check/measure.py
_.measure_prefill  # gpu_check/measure.py
_.measure_cuda_graphs  # gpu_check/measure.py
_.build_models  # gpu_check/models.py
_.check_8b_logits  # gpu_check/models.py
_.run_pytest_cuda  # gpu_check/pytest_check.py
_.tiny_models_result  # gpu_check/pytest_check.py
_.measure_bench_serve  # gpu_check/serve.py
_.check_64_streams  # gpu_check/serve.py
_.check_kill9  # gpu_check/serve.py
_.pytest_collection_modifyitems  # gpu_check/pytest_check.py: a pytest hook of the plugin it passes to pytest
_.time_limit_s  # gpu_check/report.py: CheckResult, asdict() into report.json
_.limit_mib  # gpu_check/wheel_list.py: FolderCheck, asdict() into the dry run's report

# --- the KV disk tier's counters: DiskStoreStats (executor/kv_tier/disk_store.py), for the metrics -----
_.corrupt  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.foreign  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.stores  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.store_failures  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.bytes_written  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.bytes_read  # DiskStoreStats: tests/executor/test_disk_block_store.py
_.evictions  # DiskStoreStats: tests/executor/test_disk_block_store.py
