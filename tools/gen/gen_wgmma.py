#!/usr/bin/env python3
"""Generates src/cuda/attention/sm90/wgmma_ops.cuh: inline-PTX wrappers for the
wgmma shapes the sm_90a kernels use (INT8_FP8, INT8_FP16 and FP16 modes). Inline asm operand lists cannot be built
with templates, so they are written out here once.

Usage: python3 tools/gen/gen_wgmma.py > src/cuda/attention/sm90/wgmma_ops.cuh
"""


def regs(prefix, n, start=0):
    return ", ".join(f"%{start + i}" for i in range(n))


def gen_wrapper(name, ptx_shape_types, n, a_in_registers, acc, trailing):
    """One wrapper: D(m64 x n, `acc` registers) (+)= A * B.

    A comes from four 32-bit registers (a_in_registers) or a shared-memory
    descriptor; B always from a descriptor. `trailing` are the immediate
    operands after the scale-d predicate (scale-a, scale-b, transposes)."""
    nreg = n // 2
    ctype, constraint = ("int32_t", "+r") if acc == "s32" else ("float", "+f")
    if a_in_registers:
        a_param, a_ops = "const uint32_t (&a)[4]", f"{{%{nreg}, %{nreg + 1}, %{nreg + 2}, %{nreg + 3}}}"
        b_op, pred = nreg + 4, nreg + 5
        ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)'
    else:
        a_param, a_ops = "uint64_t desc_a", f"%{nreg}"
        b_op, pred = nreg + 1, nreg + 2
        ins = '"l"(desc_a), "l"(desc_b), "r"(scale_d)'
    imms = "".join(f", {x}" for x in trailing)
    out = [f"__device__ __forceinline__ void {name}({ctype} (&d)[{nreg}], {a_param}, uint64_t desc_b, int scale_d) {{"]
    out.append("  asm volatile(")
    out.append('      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(pred) + ', 0;\\n"')
    out.append(f'      "wgmma.mma_async.sync.aligned.{ptx_shape_types} {{{regs("d", nreg)}}}, {a_ops}, %{b_op}, p{imms};\\n}}\\n"')
    outs = ", ".join(f'"{constraint}"(d[{i}])' for i in range(nreg))
    out.append(f"      : {outs}")
    out.append(f"      : {ins});")
    out.append("}")
    return "\n".join(out)


def gen_ss_s8(n):
    # D(s32, m64 x n) (+)= A(s8 smem) * B(s8 smem)^T, both K-major.
    return gen_wrapper(f"wgmma_m64n{n}k32_s8s8", f"m64n{n}k32.s32.s8.s8", n, False, "s32", [])


def gen_rs_e4m3(n):
    # D(f32, m64 x n) (+)= A(e4m3 registers) * B(e4m3 smem, K-major).
    return gen_wrapper(f"wgmma_m64n{n}k32_e4m3_rs", f"m64n{n}k32.f32.e4m3.e4m3", n, True, "f32", [1, 1])


def gen_ss_16(dt, n):
    # D(f32, m64 x n) (+)= A(16-bit smem, K-major) * B(16-bit smem, K-major)^T.
    return gen_wrapper(f"wgmma_m64n{n}k16_{dt}_ss", f"m64n{n}k16.f32.{dt}.{dt}", n, False, "f32", [1, 1, 0, 0])


def gen_rs_16_tb(dt, n):
    # D(f32, m64 x n) (+)= A(16-bit registers) * B(16-bit smem, MN-major: the
    # K x N operand stored with N contiguous, i.e. transposed).
    return gen_wrapper(f"wgmma_m64n{n}k16_{dt}_rs_tb", f"m64n{n}k16.f32.{dt}.{dt}", n, True, "f32", [1, 1, 1])


def gen_rs_16(dt, n):
    # D(f32, m64 x n) (+)= A(16-bit registers) * B(16-bit smem, K-major)^T.
    return gen_wrapper(f"wgmma_m64n{n}k16_{dt}_rs", f"m64n{n}k16.f32.{dt}.{dt}", n, True, "f32", [1, 1, 0])


# The shapes the kernels use (N of Q.K^T = keys per step; N of P.V = kernel head dim;
# N of the prediction's block scores, src/cuda/predict/sm90/, = keys per tile).
S8_QK_N = (64, 128, 192)
E4M3_PV_N = (64, 128)
F16_QK_N = (64, 128, 192)
F16_PV_N = (64, 128, 256)
F16_KS_N = (64,)


def gen_chain(call, ns, args):
    # An if-constexpr chain over N selecting the wrapper of that shape.
    out = []
    for i, n in enumerate(ns):
        kw = "if constexpr" if i == 0 else "else if constexpr"
        out.append(f"  {kw} (N == {n}) {call.format(n=n)}({args});")
    out.append(f"  else static_assert(N == {ns[0]}, \"no wgmma wrapper of this N: add it to tools/gen/gen_wgmma.py\");")
    return out


def gen_dispatch():
    # Templates by N (and by element type for the 16-bit shapes), so kernel
    # traits pick shapes by value.
    out = ["// The shapes by N: wgmma_s8_ss<N>, wgmma_e4m3_rs<N>, and by element type",
           "// Wgmma16<__half>, Wgmma16<__nv_bfloat16>.",
           "template <int N>",
           "__device__ __forceinline__ void wgmma_s8_ss(int32_t (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {"]
    out += gen_chain("wgmma_m64n{n}k32_s8s8", S8_QK_N, "d, a, b, scale_d")
    out.append("}")
    out.append("template <int N>")
    out.append("__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {")
    out += gen_chain("wgmma_m64n{n}k32_e4m3_rs", E4M3_PV_N, "d, a, b, scale_d")
    out.append("}")
    out.append("template <class T>")
    out.append("struct Wgmma16;")
    for ctype, dt in (("__half", "f16"), ("__nv_bfloat16", "bf16")):
        out.append("template <>")
        out.append(f"struct Wgmma16<{ctype}> {{")
        out.append("  template <int N>")
        out.append("  static __device__ __forceinline__ void ss_m64nNk16(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {")
        out += ["  " + x for x in gen_chain(f"wgmma_m64n{{n}}k16_{dt}_ss", F16_QK_N, "d, a, b, scale_d")]
        out.append("  }")
        out.append("  template <int N>")
        out.append("  static __device__ __forceinline__ void rs_tb_m64nNk16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {")
        out += ["  " + x for x in gen_chain(f"wgmma_m64n{{n}}k16_{dt}_rs_tb", F16_PV_N, "d, a, b, scale_d")]
        out.append("  }")
        out.append("  template <int N>")
        out.append("  static __device__ __forceinline__ void rs_m64nNk16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {")
        out += ["  " + x for x in gen_chain(f"wgmma_m64n{{n}}k16_{dt}_rs", F16_KS_N, "d, a, b, scale_d")]
        out.append("  }")
        out.append("};")
    return "\n".join(out)


def main():
    print("// Generated by tools/gen/gen_wgmma.py: do not edit by hand.")
    print("#pragma once")
    print("#include <cuda_bf16.h>")
    print("#include <cuda_fp16.h>")
    print()
    print("#include <cstdint>")
    print()
    print("namespace sparge {\nnamespace cuda {\nnamespace sm90 {\n")
    for n in S8_QK_N:
        print(gen_ss_s8(n))
        print()
    for n in E4M3_PV_N:
        print(gen_rs_e4m3(n))
        print()
    for dt in ("f16", "bf16"):
        for n in F16_QK_N:
            print(gen_ss_16(dt, n))
            print()
        for n in F16_PV_N:
            print(gen_rs_16_tb(dt, n))
            print()
        for n in F16_KS_N:
            print(gen_rs_16(dt, n))
            print()
    print(gen_dispatch())
    print()
    print("}  // namespace sm90\n}  // namespace cuda\n}  // namespace sparge")


if __name__ == "__main__":
    main()
