"""Weights as they ship and the linear layers that run them: the model store, safetensors and
GGUF loading, fp32/bf16/Q4_1/Q8_0 linears, the token embedding, and the GEMM call shapes that keep a
row's bits independent of its batch."""
