"""The CUDA sources of bench/kernel_sweep.py's new candidates (its SM edits of today's kernel are made there):
the oracle, 32-byte lanes, the uniform `stream` kernel and the TMA bulk-copy kernel."""

ORACLE = r"""
typedef long long i64;
extern "C" __global__ void oracle(const i64* __restrict__ t, i64 n) {  // one CTA per fragment, bytes
  const i64 cum0 = t[2 * n + blockIdx.x], len = t[2 * n + blockIdx.x + 1] - cum0;
  const unsigned char* s = (const unsigned char*)t[blockIdx.x];
  unsigned char* d = (unsigned char*)t[n + blockIdx.x];
  for (i64 k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
}
"""

V32 = r"""
struct alignas(16) v32 { v16 a, b; };
template <> __device__ __forceinline__ v32 ld<v32>(const v32* p) { v32 v; v.a = ld(&p->a); v.b = ld(&p->b); return v; }
template <> __device__ __forceinline__ void st<v32>(v32* p, const v32& v) { st(&p->a, v.a); st(&p->b, v.b); }
"""

STREAM = r"""
// Uniform fragments, every address 16-byte aligned, flen % 16 == 0: the chunk is a stream of 16-byte words
// and each lane keeps SU loads in flight across fragment boundaries (one division per batch).
extern "C" __global__ void __launch_bounds__(THREADS_PER_CTA)
kvb_copy_stream(const i64* __restrict__ table, i64 n, i64 chunk, i64 nchunks, i64 flen) {
  const i64* src = table;
  const i64* dst = table + n;
  const int lane = threadIdx.x & 31;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  const i64 fw = flen >> 4, cw = chunk >> 4, tw = n * fw;
  for (i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < nchunks; c += nwarps) {
    const i64 w0 = c * cw, wend = min(w0 + cw, tw);
    for (i64 wb = w0 + lane; wb < wend; wb += SU * 32) {
      const i64 i0 = wb / fw, off0 = wb - i0 * fw;
      i64 i = i0, off = off0;
      v16 r[SU];
#pragma unroll
      for (int u = 0; u < SU; ++u) {
        if (wb + u * 32 < wend) r[u] = ld(reinterpret_cast<const v16*>(src[i]) + off);
        off += 32; while (off >= fw) { off -= fw; ++i; }
      }
      i = i0; off = off0;
#pragma unroll
      for (int u = 0; u < SU; ++u) {
        if (wb + u * 32 < wend) st(reinterpret_cast<v16*>(dst[i]) + off, r[u]);
        off += 32; while (off >= fw) { off -= fw; ++i; }
      }
    }
  }
}
"""

TMA = r"""
typedef long long i64;
__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(unsigned b, unsigned parity) {
  unsigned ok = 0;
  for (long long k = 0; !ok; ++k) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(b), "r"(parity) : "memory");
    if (k > (1ll << 26)) __trap();  // a hung copy ends the sweep's process, never the machine
  }
}
// Uniform fragments cut into pieces of `piece` bytes (flen % piece == 0, both ends 16-byte aligned); CTA b
// copies pieces b, b + grid, ... through TMA_S shared-memory stages: bulk load (peer -> shared, completing
// on an mbarrier), bulk store (shared -> destination), S - 1 loads in flight. One thread drives it.
extern "C" __global__ void __launch_bounds__(32)
kvb_copy_tma(const i64* __restrict__ table, i64 n, i64 piece, i64 per_frag, i64 flen) {
  extern __shared__ __align__(128) unsigned char stage[];
  __shared__ __align__(8) unsigned long long bar[TMA_S];
  if (threadIdx.x != 0) return;
  const i64* src = table;
  const i64* dst = table + n;
  const i64 all = n * per_frag, g = gridDim.x, b0 = blockIdx.x;
  const i64 T = all > b0 ? (all - b0 + g - 1) / g : 0;
  for (int s = 0; s < TMA_S; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  for (i64 t = 0; t < T && t < TMA_S; ++t) {
    const i64 j = b0 + t * g, f = j / per_frag, off = (j - f * per_frag) * piece;
    const unsigned bb = sa(&bar[t]), d = sa(stage + t * piece);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bb), "r"((unsigned)piece) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(d), "l"(src[f] + off), "r"((unsigned)piece), "r"(bb) : "memory");
  }
  unsigned phase = 0;
  for (i64 t = 0; t < T; ++t) {
    const int s = (int)(t % TMA_S);
    mbar_wait(sa(&bar[s]), (phase >> s) & 1u);
    phase ^= 1u << s;
    {
      const i64 j = b0 + t * g, f = j / per_frag, off = (j - f * per_frag) * piece;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(dst[f] + off), "r"(sa(stage + s * piece)), "r"((unsigned)piece) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    const i64 nt = t - 1 + TMA_S;  // refill the stage of item t - 1 once its store has read it
    if (t >= 1 && nt < T) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const int ns = (int)((t - 1) % TMA_S);
      const i64 j = b0 + nt * g, f = j / per_frag, off = (j - f * per_frag) * piece;
      const unsigned bb = sa(&bar[ns]), d = sa(stage + ns * piece);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bb), "r"((unsigned)piece) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(d), "l"(src[f] + off), "r"((unsigned)piece), "r"(bb) : "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""
