"""transformers as the reference: load a checkpoint on the device, greedy tokens, full-sequence logits.

The GPU image's transformers may be older than the CPU suite's (5.x), so loading passes the
dtype under the name that version knows (`dtype` from 4.56, `torch_dtype` before) and falls
back from `device_map` (which needs accelerate on 4.x) to loading on CPU and moving.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _dtype_kwargs(dtype: Any) -> dict[str, Any]:
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_hf_model(model_dir: Path | str, dtype: Any, device: str) -> Any:
    """`AutoModelForCausalLM` in eval mode on `device`, in `dtype`."""
    from transformers import AutoModelForCausalLM

    kwargs = _dtype_kwargs(dtype)
    model: Any
    if device.startswith("cuda"):
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), device_map=device, **kwargs)
        except (ImportError, ValueError, TypeError, RuntimeError):
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs).to(device)  # type: ignore[arg-type]
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    return model.eval()


def greedy_tokens(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """HF `generate`, greedy; it stops early only at an EOS."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    eos = model.generation_config.eos_token_id or model.config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad
        )
    return out[0, len(prompt) :].tolist()


def sequence_logits(model: Any, tokens: list[int]) -> Any:
    """Logits at every position of one forward pass over `tokens`, [len(tokens), vocab] float32."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=device)).logits[0].float()
