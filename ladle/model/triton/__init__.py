"""ladle's Triton kernels for the CUDA path: the paged KV write, prefill ("extend") and split-KV
decode attention over the paged cache, and the fused per-token layer ops. Imported only by the
CUDA platform's backend and by tests (which run the kernels on the CPU under Triton's
interpreter), so that a CPU-only install never needs Triton; every launch config is pinned, never
autotuned, so results do not depend on timing.
"""
