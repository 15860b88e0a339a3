"""Triton kernels for paged attention: store_kv, paged_decode (split-K), paged_prefill. The native
CPU kernels are in model/cpu/.

Each Triton module imports triton, so import them only when the triton backend is chosen; on a
machine without CUDA they run under TRITON_INTERPRET=1, which must be set before they are
imported.
"""
