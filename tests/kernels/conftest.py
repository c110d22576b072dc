"""Kernel tests run the Triton kernels through the interpreter when there is no GPU.

The interpreter accepts a `tl.dot` of any shape, but on CUDA a dot of 16-bit inputs needs
K >= 16 (triton's nvidia backend, `min_dot_size`): a kernel that reduces over an 8-token
block passes here and fails to compile on the GPU in bfloat16. So under the interpreter the
tests hold every dot to that rule (`cuda_dot_shape_rule`).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA_MIN_DOT_SIZE = (1, 1, 16)
"""(M, N, K) lower bounds of `tl.dot` on CUDA for bfloat16/float16 inputs, the runner's CUDA dtypes."""


def _interpreter_builder():
    """The interpreter's builder (a triton internal), or None when the real kernels run."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    from triton.runtime import interpreter

    return getattr(interpreter, "interpreter_builder", None)


@pytest.fixture(autouse=True)
def cuda_dot_shape_rule(monkeypatch):
    """Under the interpreter, apply CUDA's 16-bit `tl.dot` shape rule to every dot.

    Yields whether the rule is in force; `test_interpreter_applies_the_cuda_dot_rule` fails if a
    triton upgrade moved the internals this relies on, instead of the guard silently vanishing.
    """
    builder = _interpreter_builder()
    fns = getattr(builder, "codegen_fns", None)
    if not isinstance(fns, dict) or "min_dot_size" not in fns:
        yield False
        return
    monkeypatch.setitem(fns, "min_dot_size", lambda lhs_type, rhs_type: CUDA_MIN_DOT_SIZE)
    yield True
