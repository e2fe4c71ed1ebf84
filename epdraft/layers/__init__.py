"""Draft FFN layers: router, routed experts, dense MLP, DraftMoE.

Shape legend used in names across epdraft (`x_TH`, `w13_eNH`):
    T tokens on this rank          H hidden size
    E experts in the layer         e experts held by this rank
    K top-k                        I per-expert intermediate size
    F intermediate slice held here (I / moe_tp); N = 2F (gate and up stacked)
    R rows after dispatch          S shared-expert intermediate size
"""
