"""Run the draft step's Triton launches (`epdraft.kernels.step.ops`, `epdraft.kernels.step.skinny`, the
block attention) on CPU under Triton's interpreter, against the torch code they replace.

The arithmetic and addressing check for a machine without a GPU (fp32 only: the interpreter's
bf16 tiles come out wrong, see tools/kernel_interpret.py); tests/gpu/test_step_ops.py is the
check on the device, in bf16 and fp32. Needs Triton in a scratch dir:

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tsite:. python tools/step_interpret.py
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.nn.functional as F

TOLERANCE = 1e-5  # fp32 throughout: only the order of the sums differs


def _report(rows: list[tuple[str, float]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, err in rows:
        print(f"{name:{width}s}  max |dy| / max(1, max |ref|) {err:.2e}")
    worst = max(err for _, err in rows)
    if worst > TOLERANCE:
        raise SystemExit(f"mismatch: {worst:.3g} > {TOLERANCE}")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (see the module docstring)")
    from kernel_interpret import _patch_interpreter

    _patch_interpreter()
    from epdraft.config.ffn import ActivationSpec, RouterSpec
    from epdraft.kernels import launch
    from epdraft.kernels.step import ops as step_ops, skinny
    from epdraft.kernels.step.attention import _launch, block_attention_reference
    from epdraft.layers.activations import gated_act
    from epdraft.layers.routing import route
    from epdraft.models.attention import DFlashAttention, RMSNorm, apply_rope, rope_cos_sin

    torch.manual_seed(0)
    rows: list[tuple[str, float]] = []

    def diff(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        """max |dy|, relative to max |ref| where that is above 1 (fp32 rounding scales with it)."""
        scale = max(1.0, ref.abs().max().item())
        rows.append((name, (got.float() - ref.float()).abs().max().item() / scale))

    norm = RMSNorm(96, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x, delta = torch.randn(5, 96), torch.randn(5, 96)
    diff("rms_norm", step_ops.rms_norm(x, norm.weight, 1e-6)[0], norm.reference(x))
    normed, summed = step_ops.rms_norm(x, norm.weight, 1e-6, residual=delta)
    diff("rms_norm + residual", normed, norm.reference(x + delta))
    diff("rms_norm's sum", summed, x + delta)

    N, B, h, g, D, P, C = 3, 4, 4, 2, 16, 5, 40
    attn = DFlashAttention(64, h, g, D, rms_norm_eps=1e-6, rope_theta=1e4)
    torch.nn.init.normal_(attn.q_norm.weight)
    torch.nn.init.normal_(attn.k_norm.weight)
    pool_k, pool_v = torch.zeros(P, g, C, D), torch.zeros(P, g, C, D)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor([[5], [0], [30]]) + torch.arange(B)
    q, k, v = torch.randn(N * B, h * D), torch.randn(N * B, g * D), torch.randn(N * B, g * D)
    cos, sin = attn.rope_table(C, torch.device("cpu"))
    got_q = step_ops.qk_norm_rope_store(q, k, v, attn.q_norm.weight, attn.k_norm.weight, 1e-6, cos, sin, positions,
                                        slots, pool_k, pool_v)  # fmt: skip
    rc, rs = rope_cos_sin(positions, D, 1e4)
    diff("q norm + rotary", got_q, apply_rope(attn.q_norm.reference(q.view(N, B, h, D)).transpose(1, 2), rc, rs).transpose(1, 2))
    ref_k, ref_v = torch.zeros_like(pool_k), torch.zeros_like(pool_v)
    index = (slots.unsqueeze(1), slice(None), positions)
    ref_k[index] = apply_rope(attn.k_norm.reference(k.view(N, B, g, D)).transpose(1, 2), rc, rs).transpose(1, 2)
    ref_v[index] = v.view(N, B, g, D)
    diff("k norm + rotary -> pool", pool_k, ref_k)
    diff("v -> pool", pool_v, ref_v)

    for S, lens in ((150, [150, 37]), (700, [700, 337])):  # one key split, then three (and the merge)
        kk, vv, qq = torch.randn(4, 2, S, 16), torch.randn(4, 2, S, 16), torch.randn(2, 4, 5, 16)
        sl, ln = torch.tensor([2, 1]), torch.tensor(lens)
        diff(f"block attention S={S}", _launch(qq, kk, vv, sl, ln), block_attention_reference(qq, kk, vv, sl, ln))

    for scoring in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"):
        for E, K in ((12, 1), (12, 3), (40, 4)):
            spec = RouterSpec(num_experts=E, top_k=K, scoring=scoring, norm_topk_prob=scoring != "softmax",
                              routed_scaling_factor=2.5)  # fmt: skip
            logits = torch.randn(7, E) * 3
            bias = torch.randn(E) if scoring == "sigmoid" else None
            ref_ids, ref_w = route(logits, spec, bias)
            selection = step_ops.Selection(K, scoring, bias, spec.norm_topk_prob, spec.renorm_eps,
                                           spec.routed_scaling_factor)  # fmt: skip
            ids, w = step_ops.topk_route(logits, selection)
            if not torch.equal(ids, ref_ids):
                raise SystemExit(f"topk_route {scoring} E={E} K={K}: other experts than route's")
            diff(f"topk_route {scoring} E={E} K={K}", w, ref_w)

    for scoring in ("sqrtsoftplus", "softmax_topk"):  # a bias picking low logits (softplus's small-z end)
        spec = RouterSpec(num_experts=64, top_k=4, scoring=scoring, routed_scaling_factor=1.5)
        logits, bias = torch.randn(33, 64) * 3 - 9, torch.randn(64) * 0.5
        ref_ids, ref_w = route(logits, spec, bias)
        selection = step_ops.Selection(4, scoring, bias, spec.norm_topk_prob, spec.renorm_eps, 1.5)
        ids, w = step_ops.topk_route(logits, selection)
        if not torch.equal(ids, ref_ids):
            raise SystemExit(f"topk_route {scoring} with a selection bias: other experts than route's")
        diff(f"topk_route {scoring} + selection bias, low logits", w, ref_w)

    for scoring in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"):  # a non-finite step's rows
        logits = torch.randn(40, 12)
        logits[::2] = float("nan")
        logits[1::4, 3] = float("nan")
        logits[3::8, 5] = float("-inf")
        ids, _ = step_ops.topk_route(logits, step_ops.Selection(4, scoring, None, True, 1e-20, 1.0))
        if ids.min() < 0 or ids.max() >= 12 or any(len(set(row)) != 4 for row in ids.tolist()):
            raise SystemExit(f"topk_route {scoring} of NaN / -inf logits: ids {ids.tolist()}")
        print(f"topk_route {scoring} of NaN / -inf logits: 4 distinct experts a row in [0, 12)")

    # the router's two launches against Router.forward's torch chain (fp32 F.linear (+ logit bias),
    # then route): H in several slices, in one, a slice past H's end; two E tiles; 64-row tiles past
    # T = 512. x in bf16 where the draft has it: the kernel only upcasts it, which the interpreter does right
    bf16, fp32 = torch.bfloat16, torch.float32
    # `router_topk` routes in the logits launch where it fits (8 splits; 1 split; issue13's 8 experts
    # over H = 4096 in 32), else it is the two launches (200 experts in 3 splits; 600 rows): the same bits
    for T, H, E, K, bias_kind, dtype in ((5, 1000, 12, 3, "selection", bf16), (20, 96, 24, 4, "logit", fp32),
                                         (16, 4096, 8, 2, "selection", bf16), (3, 300, 200, 6, "none", bf16),
                                         (600, 200, 8, 2, "logit", bf16)):  # fmt: skip
        x, weight, bias = torch.randn(T, H).to(dtype), torch.randn(E, H) * 3 * H**-0.5, torch.randn(E)
        linear = F.linear(x.float(), weight)
        logits = linear + bias if bias_kind == "logit" else linear
        parts = step_ops.router_logits(x, weight)
        diff(f"router_logits H={H} S={parts.shape[0]} E={E} T={T} (partials summed)", parts.sum(0), linear)
        for scoring in ("softmax", "sigmoid", "sqrtsoftplus", "softmax_topk"):
            spec = RouterSpec(num_experts=E, top_k=K, scoring=scoring, norm_topk_prob=scoring != "softmax",
                              routed_scaling_factor=2.5, bias=bias_kind)  # fmt: skip
            sel, added = (bias if bias_kind == "selection" else None), (bias if bias_kind == "logit" else None)
            ref_ids, ref_w = route(logits, spec, sel)
            selection = step_ops.Selection(K, scoring, sel, spec.norm_topk_prob, spec.renorm_eps,
                                           spec.routed_scaling_factor, added)  # fmt: skip
            ids, w = step_ops.topk_route(parts, selection)
            name = f"router {scoring} H={H} E={E} K={K} bias={bias_kind}"
            one_ids, one_w = step_ops.router_topk(x, weight, selection)
            if not (torch.equal(one_ids, ids) and torch.equal(one_w, w)):
                raise SystemExit(f"{name}: router_topk differs from router_logits + topk_route")
            if not torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values):
                raise SystemExit(f"{name}: other experts than route's")
            # compared by expert id: logits in another summation order may swap two near-equal choices
            diff(f"{name} weights", w.gather(1, ids.argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)))
    if launch.zeroed_counts("router_topk", torch.device("cpu"), step_ops._ROUTER_MAX_TILES).any():
        raise SystemExit("router_topk: the launches left an arrival count non-zero")
    parts = step_ops.router_logits(torch.randn(0, 64), torch.randn(8, 64))
    ids, w = step_ops.topk_route(parts, step_ops.Selection(2, "softmax", None, True, 0.0, 1.0, torch.randn(8)))
    if parts.shape[1:] != (0, 8) or ids.shape != (0, 2) or w.shape != (0, 2):
        shapes = f"partials {tuple(parts.shape)}, ids {tuple(ids.shape)}, weights {tuple(w.shape)}"
        raise SystemExit(f"router at T = 0: {shapes}")

    acts = (ActivationSpec(), ActivationSpec(kind="swigluoai", limit=7.0, alpha=1.702))
    gate, up = torch.randn(6, 50) * 4, torch.randn(6, 50) * 4
    for act in acts:
        swiglu = act.kind == "swiglu"
        diff(f"gated_act {act.kind}", step_ops.gated_act(gate, up, swiglu, act.limit, act.alpha), gated_act(gate, up, act))

    r, y, s, gt = torch.randn(6, 40), torch.randn(6, 40), torch.randn(6, 40), torch.randn(6, 1)
    diff("ffn_residual r + y + gated s", step_ops.ffn_residual(r, y, s, gt), r + (y + torch.sigmoid(gt) * s))
    diff("ffn_residual r + gated s", step_ops.ffn_residual(r, None, s, gt), r + torch.sigmoid(gt) * s)
    diff("ffn_residual r + y", step_ops.ffn_residual(r, y), r + y)
    gx, gw = torch.randn(6, 40), torch.randn(1, 40) / 40**0.5
    diff("ffn_residual r + y + s gated from rows", step_ops.ffn_residual(r, y, s, gate_rows_TH=gx, gate_weight_1H=gw),
         r + (y + torch.sigmoid(gx @ gw.T) * s))  # fmt: skip
    from types import SimpleNamespace

    from epdraft.models.kv_pool import KVPool

    for N, keep in ((1, None), (5, None), (5, 3), (40, 4)):
        lengths = torch.randint(0, 500, (N + 2,), dtype=torch.int32)
        slots_N, counts_N = torch.randperm(N + 1)[:N], torch.randint(0, 9, (N,))
        counts_N[-1] = 0
        pool = SimpleNamespace(lengths=lengths, pad_slot=N + 1, keep_rows=keep)
        want = KVPool.placement(pool, slots_N, counts_N, N * 8 + 3)
        got = step_ops.placement(slots_N, counts_N, lengths, N * 8 + 3, N + 1, keep)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise SystemExit(f"placement N {N} keep {keep}: {got} != {want}")
    print("placement: equal to the pool's torch chain")
    # the epilogue: the next norm as `rms_norm` makes it, and the flag set by a NaN in any row
    nw, flags = 1 + 0.1 * torch.randn(40), torch.zeros(2, dtype=torch.int32)
    for i in range(2):
        r[5, 39] = float("nan") if i else r[5, 39]
        normed = torch.empty(6, 40)
        out = step_ops.ffn_residual(r, y, epilogue=step_ops.Epilogue(nw, 1e-6, normed, flags[i : i + 1]))
        if i == 0:
            diff("ffn_residual epilogue: the next norm", normed, step_ops.rms_norm(out, nw, 1e-6)[0])
    if flags.tolist() != [0, 1]:
        raise SystemExit(f"ffn_residual epilogue: flags {flags.tolist()}, expected [0, 1]")

    x = torch.randn(5, 300)
    ws = [torch.randn(40, 300), torch.randn(16, 300), torch.randn(7, 300)]
    cfg = (16, 64, 4, 1)
    # K = 300 is 5 tiles of 64: split 4 leaves the last split no tile, 3 an uneven one
    for n, split in itertools.product((1, 2, 3), (1, 2, 3, 4)):
        diff(f"skinny linear x {n} weights, split {split}", skinny._linear(x, ws[:n], cfg, split),
             torch.cat([F.linear(x, w) for w in ws[:n]], 1))  # fmt: skip
    for act, split in itertools.product(acts, (1, 2, 4)):
        got = skinny._gate_up_act(x, ws[0], ws[0] * 0.5, act.kind == "swiglu", act.limit, act.alpha, cfg, split)
        diff(f"skinny gate_up {act.kind}, split {split}", got,
             gated_act(F.linear(x, ws[0]), F.linear(x, ws[0] * 0.5), act))  # fmt: skip
    if launch.zeroed_counts("skinny", torch.device("cpu"), skinny._MAX_TILES).any():
        raise SystemExit("skinny: the split launches left an arrival count non-zero")
    rows.append(("a draft step's norm chain (epilogues), read-out rows", _step_chain()))
    _report(rows)


def _step_chain() -> float:
    """A whole 2-layer MoE draft step with the Triton step ops (each layer's last launch making the
    next layer's input norm, the last the final norm) against the torch chain, under norms of
    distinct weights (a norm taken from the wrong layer moves every row by tens of %): the rows the
    read-out gets, max |dy| / max(1, max |ref|); SystemExit if the drafts or the flags differ."""
    from epdraft.bench.step import RandomHeads, preset_config
    from epdraft.layers.step_kernels import StepKernels
    from epdraft.models import DFlashDraft, DraftModelSpec

    shape = dict(hidden=128, heads=4, kv_heads=2, layers=2, experts=8, moe_intermediate=64, top_k=2, vocab=512,
                 block_size=16)  # fmt: skip
    spec = DraftModelSpec.from_config(preset_config(shape))
    gen = torch.Generator().manual_seed(3)
    drafts = [DFlashDraft(spec, dtype=torch.float32, device="cpu", kernels=k).eval()
              for k in (StepKernels(step_ops="triton"), StepKernels.reference())]  # fmt: skip
    with torch.no_grad():
        for name, t in drafts[0].named_parameters():
            t.copy_(1 + 0.5 * torch.randn(t.shape, generator=gen) if name.endswith("norm.weight")
                    else torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)  # fmt: skip
        drafts[1].load_state_dict(drafts[0].state_dict())
    heads = RandomHeads(spec.vocab_size, spec.hidden_size, dtype=torch.float32, device=torch.device("cpu"))
    features = [torch.randn(L, spec.num_target_features * spec.hidden_size, generator=gen) for L in (40, 1, 30)]
    read, steps = [], []
    for draft in drafts:
        pool = draft.new_pool(max_requests=4, max_context=100)
        for rid in range(3):
            pool.admit(rid)
        read_out = draft.read_out
        draft.read_out = lambda hidden, *args, read_out=read_out, **kw: read.append(hidden) or read_out(hidden, *args, **kw)
        with torch.no_grad():
            draft.extend(pool, [0, 1, 2], features)
            steps.append(draft.step(pool, torch.tensor([pool.slot(r) for r in range(3)]), torch.tensor([5, 6, 7]), heads, None))
    if not torch.equal(steps[0].drafts_NK, steps[1].drafts_NK) or steps[0].finite_L.tolist() != [True, True]:
        raise SystemExit(f"the step's norm chain: drafts or flags differ ({steps[0].finite_L.tolist()})")
    return ((read[0] - read[1]).abs().max() / read[1].abs().max().clamp(min=1)).item()


if __name__ == "__main__":
    main()
