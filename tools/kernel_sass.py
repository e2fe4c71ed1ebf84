"""Fingerprint the fused-experts GEMM kernels' sm_90 machine code, compiled on this (CPU) machine.

A refactor of `epdraft/kernels/experts/_triton.py` that should not change the generated code (helpers,
renames) is proven so without a GPU: run this before and after, each with a fresh Triton cache,
and compare the hashes. Any line that differs needs a GPU run (tools/kernel_perf.sh).

    pip download triton==3.6.0 --no-deps -d /tmp/tw && pip install --no-deps --target /tmp/tsite /tmp/tw/*.whl
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/tsite:. python tools/kernel_sass.py

Pointer and stride arguments get the 16-byte divisibility the launches see on the GPU; without it
Triton neither vectorises nor pipelines the loads and the code would not be what runs.

The last columns read the main loop (the longest backward branch): its instructions, those of the
integer ALU pipe (LOP3, PRMT, SHF, IADD3, SEL, ISETP, ...; 64 lanes a clock per SM on sm_90, half
the issue rate), and those ALU ops per weight a thread converts per iteration. A quantized kernel
bound by its upcast runs at about 64 / (ALU per weight) weights a clock per SM: a lead, not a time.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from epdraft.kernels.experts import _triton as kernels

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {
    "part_ptr": "*fp32", "arrived_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
    "num_padded_ptr": "*i32", "topk_weights_ptr": "*fp32",
}  # fmt: skip
# Scalars the launches pass that are multiples of 16 on every shipped shape (so Triton specialises them).
ALIGNED = {"F", "H", "stride_xt", "stride_we", "stride_wn", "stride_wh", "stride_se", "stride_sn", "stride_sh",
           "stride_be", "stride_hm", "stride_ps", "stride_os", "stride_om"}  # fmt: skip
FLOATS = {"limit", "alpha"}
# Strides the launches pass as 1 (x contiguous along H): Triton's JIT specialises an integer argument equal
# to 1 into a constant, and without that a tile along it is loaded one element at a time.
UNIT = {"stride_xh"}

UP = dict(TOP_K=2, ACT=0, HAS_LIMIT=False, HAS_BIAS=False, SPLIT_K=1, EVEN_K=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128,
          W_FMT=0, QBN=1, QBK=1, MXFP4_DOT_SCALED=False, W_TMA=False, PDL=False)
DOWN = dict(HAS_BIAS=False, SPLIT_K=1, EVEN_K=True, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, W_FMT=0, QBN=1, QBK=1,
            MXFP4_DOT_SCALED=False, W_TMA=False, PDL=False)
FP8 = dict(W_FMT=1, QBN=128, QBK=128)
MXFP4 = dict(W_FMT=2, MXFP4_DOT_SCALED=True)  # through tl.dot_scaled (issue 15's first path)
BITS = dict(W_FMT=2, MXFP4_DOT_SCALED=False)  # the bits path (epdraft.kernels.experts.e2m1)
SHIFT = dict(W_FMT=3, MXFP4_DOT_SCALED=False)  # the bits path on shift-packed bytes (no tables)
QUANT_POINTERS = {1: {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, 2: {"w_ptr": "*u8", "s_ptr": "*u8"},
                  3: {"w_ptr": "*u8", "s_ptr": "*u8"}}
# (name, kernel, constexprs, num_warps, num_stages, dtype of out_ptr); quantized cases last (new in issue 15)
CASES = [
    ("up", kernels.gemm1_act_kernel, UP, 4, 4, "*bf16"),
    ("up split 2, swigluoai, bias, limit, odd K", kernels.gemm1_act_kernel,
     {**UP, "SPLIT_K": 2, "ACT": 1, "HAS_BIAS": True, "HAS_LIMIT": True, "EVEN_K": False}, 4, 3, "*bf16"),
    ("up 64x64", kernels.gemm1_act_kernel, {**UP, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 4, "*bf16"),
    ("down", kernels.gemm2_weight_kernel, DOWN, 4, 4, "*bf16"),
    ("down split 4, bias, odd K", kernels.gemm2_weight_kernel,
     {**DOWN, "HAS_BIAS": True, "SPLIT_K": 4, "EVEN_K": False, "BLOCK_M": 32, "BLOCK_N": 64}, 4, 5, "*fp32"),
    ("up fp8", kernels.gemm1_act_kernel, {**UP, **FP8}, 4, 4, "*bf16"),
    ("up mxfp4", kernels.gemm1_act_kernel, {**UP, **MXFP4}, 4, 4, "*bf16"),
    ("up mxfp4 split 2, 64x64", kernels.gemm1_act_kernel,
     {**UP, **MXFP4, "SPLIT_K": 2, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 3, "*bf16"),
    ("down fp8", kernels.gemm2_weight_kernel, {**DOWN, **FP8}, 4, 4, "*bf16"),
    ("down mxfp4", kernels.gemm2_weight_kernel, {**DOWN, **MXFP4}, 4, 4, "*bf16"),
    ("up mxfp4 bits", kernels.gemm1_act_kernel, {**UP, **BITS}, 4, 4, "*bf16"),
    ("up mxfp4 bits split 2, 64x64", kernels.gemm1_act_kernel,
     {**UP, **BITS, "SPLIT_K": 2, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 3, "*bf16"),
    ("down mxfp4 bits", kernels.gemm2_weight_kernel, {**DOWN, **BITS}, 4, 4, "*bf16"),
    ("up mxfp4 bits 64x64", kernels.gemm1_act_kernel, {**UP, **BITS, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 4, "*bf16"),
    ("up mxfp4 shift", kernels.gemm1_act_kernel, {**UP, **SHIFT}, 4, 4, "*bf16"),
    ("up mxfp4 shift 64x64", kernels.gemm1_act_kernel, {**UP, **SHIFT, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 4, "*bf16"),
    ("down mxfp4 shift", kernels.gemm2_weight_kernel, {**DOWN, **SHIFT}, 4, 4, "*bf16"),
    ("up tma", kernels.gemm1_act_kernel, {**UP, "W_TMA": True}, 4, 4, "*bf16"),
    ("down tma", kernels.gemm2_weight_kernel, {**DOWN, "W_TMA": True}, 4, 4, "*bf16"),
    ("up fp8 tma", kernels.gemm1_act_kernel, {**UP, **FP8, "W_TMA": True}, 4, 4, "*bf16"),
    ("up mxfp4 bits tma", kernels.gemm1_act_kernel, {**UP, **BITS, "W_TMA": True}, 4, 4, "*bf16"),
    ("down mxfp4 bits tma", kernels.gemm2_weight_kernel, {**DOWN, **BITS, "W_TMA": True}, 4, 4, "*bf16"),
]  # fmt: skip


def sass(fn, constexprs: dict, num_warps: int, num_stages: int, out_type: str) -> tuple[str, list[str]]:
    """The kernel's SASS without addresses and encodings (equal text means equal machine code), and
    its main loop's instructions."""
    constexprs = {**{name: 1 for name in UNIT if name in fn.arg_names}, **constexprs}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "w_desc":
            signature[name] = _descriptor(constexprs) if constexprs.get("W_TMA") else "i32"
        elif name.endswith("_ptr"):
            pointers = {**POINTERS, **QUANT_POINTERS.get(constexprs["W_FMT"], {})}
            signature[name] = out_type if name == "out_ptr" else pointers.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
            if name in ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run([CUOBJDUMP, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    # "/*0a70*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;  /* 0x... */": keep the instruction only.
    code = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip() for line in dump.splitlines() if "/*" in line)
    return code, main_loop(dump)


def _descriptor(constexprs: dict) -> str:
    """The weight TMA descriptor's type: [1, BLOCK_N, BLOCK_K stored elements] of the format's dtype."""
    fmt = constexprs["W_FMT"]
    dtype = {0: "bf16", 1: "fp8e4nv", 2: "u8", 3: "u8"}[fmt]
    cols = constexprs["BLOCK_K"] // (2 if fmt >= 2 else 1)
    return f"tensordesc<{dtype}[1,{constexprs['BLOCK_N']},{cols}]>"


ALU_OPS = ("LOP3", "PRMT", "SHF", "IADD3", "SEL", "ISETP", "PLOP3", "LEA", "IMNMX", "FSEL", "BFE", "BFI")


def main_loop(dump: str) -> list[str]:
    """The instructions of the main loop: of the spans from a backward branch's target to the branch,
    the one holding the most matrix instructions, the shortest of those (a TMA wait's retry stub at
    the kernel's end branches back into the loop too, and its span runs over the epilogue)."""
    lines = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s*([^;]*);", dump)]
    best: list[str] = []
    for address, ins in lines:
        target = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < address:
            body = [i for a, i in lines if int(target.group(1), 16) <= a <= address]
            if (_mma(body), -len(body)) > (_mma(best), -len(best)):
                best = body
    return best


def _mma(body: list[str]) -> int:
    return sum(1 for ins in body if "MMA" in ins.split()[ins.startswith("@")])


def main() -> None:
    print(f"{'kernel (sm_90, Triton ' + triton.__version__ + ')':45s} {'sha256 of SASS':18s} {'instructions':>12s}"
          f" {'loop':>5s} {'ALU':>5s} {'ALU/weight':>10s}")
    for name, fn, constexprs, num_warps, num_stages, out_type in CASES:
        code, loop = sass(fn, constexprs, num_warps, num_stages, out_type)
        alu = sum(1 for ins in loop if ins.split()[ins.startswith("@")].split(".")[0] in ALU_OPS)
        tiles = 2 if fn is kernels.gemm1_act_kernel else 1  # gate and up
        weights = tiles * constexprs["BLOCK_N"] * constexprs["BLOCK_K"] / (32 * num_warps)
        print(f"{name:45s} {hashlib.sha256(code.encode()).hexdigest()[:16]:18s} {code.count(chr(10)) + 1:>12d}"
              f" {len(loop):>5d} {alu:>5d} {alu / weights:>10.2f}")


if __name__ == "__main__":
    main()
