"""The draft step's kernels: its small fused ops (`ops`: norms with the residual add, q/k norm +
rotary + KV-pool write, the router's logits and top-k, activations, the FFN's output add), its dense
projections at few rows (`skinny`) and the block attention over the KV pool (`attention`). Each
equals a torch chain that stays the CPU path; `ops.unsupported_reason` says when they cannot run.
"""
