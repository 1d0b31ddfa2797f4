"""The tail forward as a hand-written CUDA thread-block cluster, built with NVRTC (issue 18).

Session 13 timed Triton 3.9's cluster builds of the forward (num_ctas) and found them slower
than profuse's row teams at every width (44-73% of copy at 32M elements). Whether a cluster
kernel as such can do better, with the row's partial sums crossing distributed shared memory
instead of the L2, is the question that decides whether a kernel outside Triton is worth
having for the widest rows. This builds one, written for the question: a cluster of CTAS CTAs
takes one row, CTA c holding columns [c * BLOCK, (c + 1) * BLOCK) in registers; each CTA sums
its share's h^2 (warp shuffles, then its warps in order), the cluster waits on one barrier, every
CTA reads the CTAS partial sums from its partners' shared memory in rank order (the same bits in
each), signals that it has read them, writes its share of y, and waits for its partners' signal
only before it exits (its shared memory must outlive their reads). Rows are whole multiples of
BLOCK * CTAS wide; bf16 only.

Session 18, H200, 32M elements: every build right (as profuse's against float64) and slower:
85.4-93.4 us at 1024 x 32768 (68-74% of copy) against profuse's row team at 71.3-72.1, 88.9-96.1
at 512 x 65536 against 72.0-72.2; built without the exchange (`--no-exchange`: wrong answers,
timed only) 72.8-76.3 us whether launched as clusters or as a plain grid. The cluster's exchange
costs 10-20 us where the row team's through the L2 costs 2-4.4 (benchmarks/NOTES.md).

`build` needs NVRTC (the cuda-bindings package; no GPU) and writes NAME.cubin and NAME.json in
the layout benchmarks/cluster_probe.py's `time` reads, which checks them against float64 and
profuse's tuned forward and times them in turns under the harness's L2 flush:

    PYTHONPATH=src python benchmarks/cluster_cuda.py build --out cubins --cols 32768 --no-exchange
    PYTHONPATH=src python benchmarks/cluster_probe.py time --cubins cubins --shapes 1024x32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster_probe import SCRATCH, ptxas_usage, write_build  # SCRATCH: two pointers `time` passes, unused

from profuse.cli import int_list

# (n_cols, BLOCK, THREADS, CTAS): columns a CTA, threads a CTA, CTAs a row (at most 8, the
# portable cluster size); BLOCK / THREADS elements a thread, a multiple of 8 (16-byte loads).
CONFIGS = [
    (16384, 4096, 128, 4), (16384, 4096, 256, 4), (16384, 2048, 128, 8),
    (32768, 4096, 128, 8), (32768, 4096, 256, 8), (32768, 8192, 256, 4), (32768, 8192, 512, 4),
    (65536, 8192, 256, 8), (65536, 8192, 512, 8),
]  # fmt: skip

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define VEC 8                      // bf16 a 16-byte load
#define PER (BLOCK / THREADS)      // elements a thread
#define NV (PER / VEC)             // 16-byte loads a thread, per tensor
#define WARPS (THREADS / 32)

__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u32 pack(float low, float high) {
    u32 d;  // cvt puts its first source in the upper half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(high), "f"(low));
    return d;
}
__device__ __forceinline__ uint4 load_once(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void store_once(uint4* p, uint4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ float h_of(float g, float u, float r) {
    return g / (1.0f + __expf(-g)) * u + r;
}

extern "C" __global__ void __launch_bounds__(THREADS) tail_fwd_cluster(
    const unsigned short* __restrict__ G, const unsigned short* __restrict__ U,
    const unsigned short* __restrict__ R, const unsigned short* __restrict__ W,
    unsigned short* __restrict__ Y, float* __restrict__ RSTD,
    int g_stride, int u_stride, int r_stride, int y_stride, int n_rows, int n_cols, float eps,
    u64 scratch0, u64 scratch1)
{
    __shared__ float warp_sums[WARPS];
    __shared__ float cta_sum;
#if EXCHANGE
    u32 rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#else
    const u32 rank = blockIdx.x % CTAS;
#endif
    const long long row = blockIdx.x / CTAS;
    const int col0 = rank * BLOCK;
    const int t = threadIdx.x;
    // Thread t holds 16-byte vectors j * THREADS + t of the share: each load instruction of a
    // warp covers 512 contiguous bytes.
    const uint4* g = (const uint4*)(G + row * g_stride + col0);
    const uint4* u = (const uint4*)(U + row * u_stride + col0);
    const uint4* r = (const uint4*)(R + row * r_stride + col0);
    uint4 gv[NV], uv[NV], rv[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) {
        gv[j] = load_once(g + j * THREADS + t);
        uv[j] = load_once(u + j * THREADS + t);
        rv[j] = load_once(r + j * THREADS + t);
    }
    float h[PER];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const u32 gw[4] = {gv[j].x, gv[j].y, gv[j].z, gv[j].w};
        const u32 uw[4] = {uv[j].x, uv[j].y, uv[j].z, uv[j].w};
        const u32 rw[4] = {rv[j].x, rv[j].y, rv[j].z, rv[j].w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float a = h_of(lo(gw[k]), lo(uw[k]), lo(rw[k]));
            float b = h_of(hi(gw[k]), hi(uw[k]), hi(rw[k]));
            h[j * VEC + 2 * k] = a;
            h[j * VEC + 2 * k + 1] = b;
            ss += a * a + b * b;
        }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    if ((t & 31) == 0) warp_sums[t >> 5] = ss;
    __syncthreads();
    if (t == 0) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS; k++) s += warp_sums[k];
        cta_sum = s;
    }
#if EXCHANGE
    // Every CTA's sum is in its shared memory once the whole cluster has arrived.
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    u32 local;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(local) : "l"(&cta_sum));
    float total = 0.0f;
#pragma unroll
    for (int c = 0; c < CTAS; c++) {
        u32 remote;
        float v;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(c));
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
        total += v;
    }
    // Read: partners may leave once every CTA has said so (the wait is just before the exit).
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __syncthreads();
    const float total = cta_sum * CTAS;  // no exchange: wrong answers, for timing only
#endif
    const float rstd = rsqrtf(total / n_cols + eps);
    const uint4* w = (const uint4*)(W + col0);
    uint4* y = (uint4*)(Y + row * y_stride + col0);
#pragma unroll
    for (int j = 0; j < NV; j++) {
        const uint4 wv = w[j * THREADS + t];
        const u32 ww[4] = {wv.x, wv.y, wv.z, wv.w};
        u32 out[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            out[k] = pack(h[j * VEC + 2 * k] * rstd * lo(ww[k]), h[j * VEC + 2 * k + 1] * rstd * hi(ww[k]));
        store_once(y + j * THREADS + t, make_uint4(out[0], out[1], out[2], out[3]));
    }
    if (rank == 0 && t == 0) RSTD[row] = rstd;
#if EXCHANGE
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
"""


def compile_config(n_cols: int, block: int, threads: int, ctas: int, exchange: bool = True,
                   cluster: bool = True) -> tuple[bytes, dict]:  # fmt: skip
    """One config's cubin for sm_90 and what cluster_probe.py's `time` needs to launch it. Without
    `exchange` each CTA takes its own share's sum as the row's (wrong answers: `time` times it
    but reports it as such); without `cluster` it is launched as a plain grid."""
    from cuda.bindings import nvrtc

    def check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"nvrtc: {err}")
        return rest[0] if len(rest) == 1 else rest

    prog = check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"tail_fwd_cluster.cu", 0, [], []))
    macros = dict(BLOCK=block, THREADS=threads, CTAS=ctas, EXCHANGE=int(exchange))
    opts = [b"-arch=sm_90", b"-std=c++17", b"-default-device", b"--ptxas-options=-v", b"-lineinfo"]
    opts += [f"-D{k}={v}".encode() for k, v in macros.items()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    size = check(nvrtc.nvrtcGetProgramLogSize(prog))
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(prog, log))
    log = log.decode(errors="replace")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtc could not compile: {log.strip()}")
    size = check(nvrtc.nvrtcGetCUBINSize(prog))
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(prog, cubin))
    meta = dict(kernel="tail_fwd_cluster", shared=0, num_warps=threads // 32, num_ctas=ctas, cols=n_cols,
                block_n=block, even=True, nvrtc=".".join(map(str, check(nvrtc.nvrtcVersion()))))  # fmt: skip
    meta.update(ptxas_usage(log))
    for s in SCRATCH:
        meta[f"{s}_size"], meta[f"{s}_align"] = 0, 1
    meta["cluster_dim"] = ctas if cluster else 1
    if not exchange:
        meta["timing_only"] = "no exchange: each CTA takes its own share's sum as the row's"
    return cubin, meta


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile CONFIGS to cubins with NVRTC (no GPU needed)")
    b.add_argument("--out", required=True, help="folder for NAME.cubin and NAME.json")
    b.add_argument("--cols", type=int_list, default=None, help="only the configs of these widths")
    b.add_argument("--no-exchange", action="store_true",
                   help="also build each config without the exchange (wrong answers, for timing), "
                   "launched as clusters and as a plain grid")  # fmt: skip
    args = p.parse_args()
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        print("error: build needs NVRTC from the cuda-bindings package (pip install cuda-bindings "
              "nvidia-cuda-nvrtc-cu12)", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out)
    configs = [c for c in CONFIGS if args.cols is None or c[0] in args.cols]
    if not configs:
        print(f"error: --cols {args.cols}: no configs of these widths (see CONFIGS)", file=sys.stderr)
        return 2
    kinds = [("", True, True)] + ([("_noexch", False, True), ("_noexch_plain", False, False)]
                                  if args.no_exchange else [])  # fmt: skip
    for n_cols, block, threads, ctas in configs:
        for suffix, exchange, cluster in kinds:
            name = f"cuda_fwd_n{n_cols}_b{block}_t{threads}_c{ctas}{suffix}"
            try:
                cubin, meta = compile_config(n_cols, block, threads, ctas, exchange, cluster)
            except RuntimeError as err:
                print(f"error: {name}: {err}", file=sys.stderr)
                return 2
            print(write_build(out, name, cubin, meta), flush=True)
    print(f"wrote {len(configs) * len(kinds)} cubins into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
