"""Pallas (and jax-triton) kernels of gem-jax: one folder per kernel family (../shared/DESIGN.md, "Kernels")."""

# The names the package's Pallas kernels are compiled under (pallas_call(name=...)): a compiled program's
# Triton calls carry them, and an interpreted kernel's ops sit under a named scope of the same name, which is
# how gem_jax/observe/compiled.py tells a compiled kernel from an interpreted one.
PALLAS_KERNELS = ("hstu_attention_fwd", "hstu_attention_dq", "hstu_attention_dkv",
                  "jagged_softmax_attention_fwd", "jagged_softmax_attention_dq", "jagged_softmax_attention_dkv",
                  "fp8_mx_gemm", "fp8_scaled_gemm")
