"""The routed experts' kernels: fused gate/up + activation and down + combine GEMMs over tokens
aligned by expert, on bf16 / FP8 e4m3 / MXFP4 weights (`weights.ExpertWeights`) decoded with
integer ops after each tile's load (`e2m1`, `e4m3`), launched with tiles from per-shape tuned tables
(`tables`; `epdraft bench kernel --tune` writes them). `fused.unsupported_reason` says when they
cannot run.
"""
