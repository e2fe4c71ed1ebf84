"""Triton kernels on CUDA, one folder per family; plain tensors and ints in, no config objects.

    experts/   the routed experts: fused kernels on bf16 / FP8 / MXFP4 storage, the pair alignment,
               the weight formats and their integer decodes, the tuned launch tables
    step/      the draft step's ops: norms, q/k norm + rotary + KV-pool write, router launches,
               activations, skinny projections, block attention
    launch.py  what every launch shares (PDL, tile sizing)

Which family runs for a rank is decided once, by `epdraft.layers.step_kernels.StepKernels`; each family
says why it cannot run (`unsupported_reason`). Importing this package imports neither Triton nor
touches CUDA: a kernel module is loaded the first time one of its kernels launches.
"""
