"""LoRA adapters on the served model: many fine-tunes of one base model in one executor.

- `adapter_spec`: the `--lora NAME=PATH` entries, their names checked once;
- `peft_config`: an adapter's `adapter_config.json` as PEFT writes it (its rank, its scaling, the
  features refused);
- `peft_weights`: its `adapter_model.safetensors`, checked against the base model's shapes;
- `adapter`: an adapter in the forward pass's fused layout (q/k/v and gate/up side by side);
- `slots`: at most `--max-loras` adapters resident on the device, the least recently used swapped out;
- `step_deltas`: one step's rows per adapter, and each targeted product's low-rank delta;
- `adapter_set`: what the runner holds: the adapters by name, their slots, a step's deltas.
"""
