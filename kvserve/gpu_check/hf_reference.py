"""transformers as the reference: a checkpoint on the device, its greedy tokens, its logits, on the
image's transformers, which may be older than the suite's (`torch_dtype` before 4.56, no accelerate).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def load_hf_model(model_dir: Path | str, dtype: Any, device: str) -> Any:
    """`AutoModelForCausalLM` in eval mode on `device`, in `dtype`."""
    import transformers

    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    kwargs = {"dtype" if version >= (4, 56) else "torch_dtype": dtype}
    load = transformers.AutoModelForCausalLM.from_pretrained
    try:
        return load(str(model_dir), device_map=device, **kwargs).eval()
    except (ImportError, ValueError, TypeError, RuntimeError):
        return load(str(model_dir), **kwargs).to(device).eval()  # type: ignore[arg-type]


def greedy_tokens(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """HF `generate`, greedy; it stops early only at an EOS."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
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

    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float()
