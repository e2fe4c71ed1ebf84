"""epdraft.kernels."""
