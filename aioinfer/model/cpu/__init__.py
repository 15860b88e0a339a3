"""The native CPU backend, in one folder:

    kernels.c           the C kernels (linears, norms, activations, rotary, paged attention,
                        whole decoder layers, the sampler's top_p and race, the greedy head)
    kernels.py          builds kernels.c with the system C compiler and loads it with ctypes
    packed_weights.py   float32 weights in strips, and GGUF's byte codes, as the kernels read them
    greedy_head.py      the exact greedy LM head over a bf16 screen
    layers.py           the kernels as drop-in modules swapped into a loaded float32 model
    attention.py        the CPU attention backend (native paged decode and prefill)
    kv_prefault.py      the CPU KV cache's pages faulted in ahead of use while the engine idles

gpu/ (the runner, the sampler) chooses and loads them; nothing else in model/ imports this folder.
"""
