"""A tiny PTX interpreter for the kernels' inline asm, on numpy uint32 arrays (tests and the CPU tools).

It runs exactly the instructions `epdraft.kernels.experts.e2m1` uses and refuses any other, so a change to
that PTX either keeps being checked here or fails loudly. Semantics are the PTX ISA's:
    and.b32 / or.b32 / xor.b32  bitwise; shl.b32 / shr.u32 by an immediate
    mul.hi.u32 d, a, b          the high 32 bits of a * b
    prmt.b32 d, a, b, c         default mode: result byte i is byte (c >> 4i) & 7 of {b, a}
                                (a bytes 0-3, b bytes 4-7), or that byte's sign bit replicated
                                when (c >> 4i) & 8
    lop3.b32 d, a, b, c, lut    bit-wise lut[(a << 2) | (b << 1) | c]
    mov.b32 d, a                a
    mul.rn.bf16x2 d, a, b       each 16-bit lane a bf16 product, rounded to nearest even (exact
                                whenever the product is a float32: every use in epdraft)
Operands are `$N` (outputs first, then inputs, as Triton numbers them), names declared with `.reg
.b32`, or integer immediates.
"""

from __future__ import annotations

import re

import numpy as np

_U32 = np.uint32


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    data = (b.astype(np.uint64) << np.uint64(32)) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=_U32)
    for i in range(4):
        sel = (c >> _U32(4 * i)) & _U32(0xF)
        byte = ((data >> ((sel & _U32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(_U32)
        byte = np.where(sel & _U32(8), np.where(byte & _U32(0x80), _U32(0xFF), _U32(0)), byte)
        out |= byte << _U32(8 * i)
    return out


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    out = np.zeros_like(a, dtype=_U32)
    for index in range(8):
        if lut >> index & 1:
            out |= ((a if index & 4 else ~a) & (b if index & 2 else ~b) & (c if index & 1 else ~c)).astype(_U32)
    return out


def _mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a, dtype=_U32)
    for shift in (0, 16):
        fa = ((a >> _U32(shift)) << _U32(16)).astype(_U32).view(np.float32).astype(np.float64)
        fb = ((b >> _U32(shift)) << _U32(16)).astype(_U32).view(np.float32).astype(np.float64)
        bits = (fa * fb).astype(np.float32).view(_U32)  # bf16 x bf16 is exact in float64
        rounded = (bits.astype(np.uint64) + 0x7FFF + ((bits >> _U32(16)) & _U32(1))) >> np.uint64(16)
        out |= (rounded.astype(_U32) & _U32(0xFFFF)) << _U32(shift)
    return out


_OPS = {
    "mov.b32": lambda a: a,
    "mul.rn.bf16x2": _mul_bf16x2,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shl.b32": lambda a, b: a << b,
    "shr.u32": lambda a, b: a >> b,
    "mul.hi.u32": lambda a, b: ((a.astype(np.uint64) * b.astype(np.uint64)) >> np.uint64(32)).astype(_U32),
    "prmt.b32": _prmt,
}


def run_ptx(asm: str, num_outputs: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run `asm` once per element of the (equally shaped) uint32 `inputs`; returns the outputs' uint32 arrays.

    Raises:
        ValueError: an instruction or operand this emulator does not know.
    """
    shape = np.broadcast(*inputs).shape
    regs: dict[str, np.ndarray] = {}
    for i, value in enumerate(inputs):
        regs[f"${num_outputs + i}"] = np.broadcast_to(np.asarray(value, dtype=_U32), shape)

    def read(operand: str) -> np.ndarray:
        if operand in regs:
            return regs[operand]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", operand):
            return np.full(shape, int(operand, 0) & 0xFFFFFFFF, dtype=_U32)
        raise ValueError(f"ptx emulator: operand {operand!r} read before it is written")

    for statement in asm.replace("{", ";").replace("}", ";").split(";"):
        statement = statement.split("//")[0].strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        dest, sources = args[0], [read(a) for a in args[1:]]
        if opcode == "lop3.b32":
            regs[dest] = _lop3(*sources[:3], int(args[4], 0))
        elif opcode in _OPS:
            regs[dest] = np.asarray(_OPS[opcode](*sources), dtype=_U32)
        else:
            raise ValueError(f"ptx emulator: unsupported instruction {statement!r}")
    return [regs[f"${i}"] for i in range(num_outputs)]


def run_elementwise(asm: str, constraints: str, inputs: list[np.ndarray], out_dtypes: list[np.dtype],
                    pack: int) -> list[np.ndarray]:
    """`tl.inline_asm_elementwise` on numpy arrays: `pack` consecutive elements per asm instance.

    Inputs and outputs narrower than 32 bits are packed into 32-bit registers, element 0 in the low
    bits (Triton's packing); each input is [n] of its own dtype with n % pack == 0.
    """
    def regs_of(values: np.ndarray) -> list[np.ndarray]:
        per_reg = 4 // values.dtype.itemsize  # elements per 32-bit register
        raw = values.reshape(-1, pack // per_reg, per_reg).view(np.uint8)  # [n / pack, registers, 4]
        return [raw[:, r, :].copy().view(_U32).reshape(-1) for r in range(pack // per_reg)]

    in_regs = [r for values in inputs for r in regs_of(np.ascontiguousarray(values))]
    out_regs_per = [pack // (4 // np.dtype(d).itemsize) for d in out_dtypes]
    if len(constraints.split(",")) != sum(out_regs_per) + len(in_regs):
        raise ValueError(f"ptx emulator: constraints {constraints!r} do not match the packed operands")
    results = run_ptx(asm, sum(out_regs_per), in_regs)
    outs, first = [], 0
    for dtype, count in zip(out_dtypes, out_regs_per):
        words = np.stack(results[first:first + count], axis=1)  # [n / pack, count] uint32
        outs.append(words.view(np.uint8).reshape(-1).view(np.dtype(dtype)))
        first += count
    return outs
