// OUTSIDE THE BUILD (dev/cuda/README.md): an experimental variant, never run on a GPU.
//
// Causal grouped-query attention on the tensor cores through register-level mma.sync (m16n8k16,
// bf16 or fp16 inputs, fp32 accumulation). Same contracts as the WMMA kernels of cuda_attention_tc.cu (q, k, v, dO and the
// probabilities and dS rounded to the dtype, softmax statistics, outputs and gradients fp32),
// without their shared-memory round trips: score tiles, probabilities and accumulators stay in
// registers. benchmarks/mma_attention_emulation.py replays their index math lane by lane.
//
// Blocking (FlashAttention-2's): a block owns 64 query rows, four warps of 16; it streams the
// keys up to its diagonal in tiles of 64 through shared memory, K row-major and V transposed, so
// that every mma operand is a 32-bit shared-memory load of two adjacent elements.
//
// Register layouts of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major), four 32-bit registers of two elements each:
//     a[0] = (row g, cols 2t, 2t+1)   a[1] = (row g+8, cols 2t, 2t+1)
//     a[2] = (row g, cols 2t+8, +9)   a[3] = (row g+8, cols 2t+8, +9)
//   B (16 x 8, column-major): b[0] = (rows 2t, 2t+1; col g), b[1] = (rows 2t+8, 2t+9; col g)
//   C (16 x 8, fp32): c[0], c[1] = (row g, cols 2t, 2t+1), c[2], c[3] = (row g+8, same cols)
// The element of lower index sits in the lower half of a register. A C tile of scores for keys
// 16j..16j+15 is therefore, register for register, the A operand of P V for those keys.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "model/cuda_ops_internal.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the mma.sync attention needs sm_80 or newer (bf16 m16n8k16): set CMAKE_CUDA_ARCHITECTURES"
#endif

namespace strata::model::cuda::detail {
namespace {

constexpr int kMmaRows = 64;   // query rows per block
constexpr int kMmaKeys = 64;   // keys per streamed tile
constexpr int kMmaWarps = 4;   // 16 query rows each
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaPad = 8;     // 16-bit elements added to each shared row: conflict-free loads

template <typename T>
__device__ inline uint32_t Pack(float lo, float hi);
template <>
__device__ inline uint32_t Pack<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ inline uint32_t Pack<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// c += A B for one 16 x 8 tile.
template <typename T>
__device__ inline void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ inline void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ inline void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ inline uint32_t Load32(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Two adjacent floats of row `row` (zeros past seq), as one packed pair.
template <typename T>
__device__ inline uint32_t LoadPair(const float* __restrict__ base, size_t stride, size_t row,
                                    size_t seq, int col) {
  if (row >= seq) return 0u;
  const float2 v = *reinterpret_cast<const float2*>(base + row * stride + col);
  return Pack<T>(v.x, v.y);
}

// Shared-memory tiles: [64, D] row-major (ld kRowLd) and [D, 64] transposed (ld kColLd), and
// what each kernel carves from them.
template <typename T, int D>
struct MmaSmem {
  static constexpr int kRowLd = D + kMmaPad;
  static constexpr int kColLd = kMmaKeys + kMmaPad;
  static constexpr size_t kTile = size_t{kMmaKeys} * kRowLd * sizeof(T);
  static constexpr size_t kTileT = size_t{D} * kColLd * sizeof(T);
  // Forward: K row-major, V transposed.
  static constexpr size_t kForward = kTile + kTileT;
  // Backward keys kernel: K, V, Q, dO row-major; Q and dO transposed; the query tile's lse and
  // delta.
  static constexpr size_t kKeys = 4 * kTile + 2 * kTileT + 2 * kMmaRows * sizeof(float);
  // Backward queries kernel: K and V row-major, K transposed.
  static constexpr size_t kQueries = 2 * kTile + kTileT;
  static_assert(kTile % 16 == 0 && kTileT % 16 == 0, "pieces keep 16-byte alignment");
};

// Rows first.. first + 63 of `src` (zeros past seq), rounded: into `rows` ([64, D], ld kRowLd)
// and/or `cols` (transposed, [D, 64], ld kColLd); either may be null.
template <typename T, int D>
__device__ inline void StageRows(const float* __restrict__ src, size_t stride, size_t first,
                                 size_t seq, T* __restrict__ rows, T* __restrict__ cols) {
  using L = MmaSmem<T, D>;
  constexpr int kQuads = D / 4;
  for (int idx = static_cast<int>(threadIdx.x); idx < kMmaKeys * kQuads; idx += kMmaThreads) {
    const int r = idx / kQuads, c = (idx % kQuads) * 4;
    const size_t row = first + static_cast<size_t>(r);
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row < seq) x = *reinterpret_cast<const float4*>(src + row * stride + c);
    const T e[4] = {Round16<T>(x.x), Round16<T>(x.y), Round16<T>(x.z), Round16<T>(x.w)};
    if (rows != nullptr) {
#pragma unroll
      for (int i = 0; i < 4; ++i) rows[r * L::kRowLd + c + i] = e[i];
    }
    if (cols != nullptr) {
#pragma unroll
      for (int i = 0; i < 4; ++i) cols[(c + i) * L::kColLd + r] = e[i];
    }
  }
}

// Accumulator tiles 2j and 2j + 1 (16 x 8 each, fp32) as one 16 x 16 A fragment, rounded.
template <typename T>
__device__ inline void AccumulatorsToA(const float (&lo)[4], const float (&hi)[4],
                                       uint32_t (&a)[4]) {
  a[0] = Pack<T>(lo[0], lo[1]);
  a[1] = Pack<T>(lo[2], lo[3]);
  a[2] = Pack<T>(hi[0], hi[1]);
  a[3] = Pack<T>(hi[2], hi[3]);
}

// Block (b * num_heads + h, reversed query tile): O and lse of 64 query rows.
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    MmaForwardKernel(const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v, AttentionShape s, float* __restrict__ out,
                     float* __restrict__ lse) {
  using L = MmaSmem<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vt = ks + kMmaKeys * L::kRowLd;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;

  const size_t b = blockIdx.x / s.num_heads, h = blockIdx.x % s.num_heads, kvh = h / s.group;
  const size_t tiles = (s.seq + kMmaRows - 1) / kMmaRows;
  const size_t qt = tiles - 1 - blockIdx.y;  // the longest rows start first
  const size_t row0 = qt * kMmaRows + static_cast<size_t>(warp) * 16 + static_cast<size_t>(g);
  const size_t row1 = row0 + 8;
  const float* qb = q + b * s.seq * s.q_stride + h * D;
  const float* kb = k + b * s.seq * s.kv_stride + kvh * D;
  const float* vb = v + b * s.seq * s.kv_stride + kvh * D;

  // The warp's 16 query rows as A fragments, one per 16 columns of the head.
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qa[kk][0] = LoadPair<T>(qb, s.q_stride, row0, s.seq, kk * 16 + 2 * t);
    qa[kk][1] = LoadPair<T>(qb, s.q_stride, row1, s.seq, kk * 16 + 2 * t);
    qa[kk][2] = LoadPair<T>(qb, s.q_stride, row0, s.seq, kk * 16 + 2 * t + 8);
    qa[kk][3] = LoadPair<T>(qb, s.q_stride, row1, s.seq, kk * 16 + 2 * t + 8);
  }
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // Softmax state in the base-2 domain (scores times scale * log2(e)); each lane's l is its
  // partial row sum over its own columns (the quad's four are added at the end).
  const float scale2 = s.scale * 1.4426950408889634f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

  for (size_t kt = 0; kt <= qt; ++kt) {
    const size_t k0 = kt * kMmaKeys;
    __syncthreads();  // every warp is done with the previous tile
    StageRows<T, D>(kb, s.kv_stride, k0, s.seq, ks, nullptr);
    StageRows<T, D>(vb, s.kv_stride, k0, s.seq, nullptr, vt);
    __syncthreads();

    // S = Q K^T: eight 16 x 8 tiles of keys.
    float sc[kMmaKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
      const T* krow = ks + (n * 8 + g) * L::kRowLd + 2 * t;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        Mma<T>(sc[n], qa[kk], Load32(krow + kk * 16), Load32(krow + kk * 16 + 8));
      }
    }
    // Scale, mask (keys after the row or past seq weigh 0), and the rows' maxima.
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const size_t key = k0 + static_cast<size_t>(n * 8 + 2 * t + j);
        const bool live = key < s.seq;
        sc[n][j] = live && key <= row0 ? sc[n][j] * scale2 : -INFINITY;
        sc[n][2 + j] = live && key <= row1 ? sc[n][2 + j] * scale2 : -INFINITY;
        mx0 = fmaxf(mx0, sc[n][j]);
        mx1 = fmaxf(mx1, sc[n][2 + j]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
    const float base0 = new0 == -INFINITY ? 0.0f : new0;  // a row with no key yet
    const float base1 = new1 == -INFINITY ? 0.0f : new1;
    const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);  // 0 while m is -inf
    m0 = new0;
    m1 = new1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
      sc[n][0] = exp2f(sc[n][0] - base0);
      sc[n][1] = exp2f(sc[n][1] - base0);
      sc[n][2] = exp2f(sc[n][2] - base1);
      sc[n][3] = exp2f(sc[n][3] - base1);
      sum0 += sc[n][0] + sc[n][1];
      sum1 += sc[n][2] + sc[n][3];
    }
    l0 = l0 * corr0 + sum0;
    l1 = l1 * corr1 + sum1;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= corr0;
      o[n][1] *= corr0;
      o[n][2] *= corr1;
      o[n][3] *= corr1;
    }
    // O += P V, 16 keys at a time: the score tiles 2j and 2j + 1 are P's A fragment.
#pragma unroll
    for (int j = 0; j < kMmaKeys / 16; ++j) {
      uint32_t pa[4];
      AccumulatorsToA<T>(sc[2 * j], sc[2 * j + 1], pa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const T* vrow = vt + (n * 8 + g) * L::kColLd + j * 16 + 2 * t;
        Mma<T>(o[n], pa, Load32(vrow), Load32(vrow + 8));
      }
    }
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  constexpr float kLn2 = 0.6931471805599453f;
  float* ob = out + b * s.seq * s.q_stride + h * D;
  float* lb = lse + (b * s.num_heads + h) * s.seq;
  if (row0 < s.seq) {
    const float inv = 1.0f / l0;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(ob + row0 * s.q_stride + n * 8 + 2 * t) =
          make_float2(o[n][0] * inv, o[n][1] * inv);
    }
    if (t == 0) lb[row0] = (m0 + log2f(l0)) * kLn2;
  }
  if (row1 < s.seq) {
    const float inv = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<float2*>(ob + row1 * s.q_stride + n * 8 + 2 * t) =
          make_float2(o[n][2] * inv, o[n][3] * inv);
    }
    if (t == 0) lb[row1] = (m1 + log2f(l1)) * kLn2;
  }
}

// ---- backward -----------------------------------------------------------------------------------
//
// FlashAttention-2's backward without atomics (as the WMMA kernels): one kernel per key tile
// accumulates dK and dV over the query tiles at or after it and the query heads of its kv group;
// another per query tile accumulates dQ over the key tiles up to its diagonal. Both recompute P
// from the forward's lse. A warp owns 16 rows (keys or queries); its score tiles, P and dS stay
// in registers, and the accumulators of 16 columns serve as the next product's A operand. The
// operands a product reads along its other side are staged in shared memory both row-major and
// transposed, so that every B fragment is a 32-bit load of two adjacent elements.

// The A fragment of rows 0..15 of a row-major shared tile (`base` at its column kk * 16).
__device__ inline void LoadA(const void* base_v, int ld, int g, int t, uint32_t (&a)[4]) {
  const uint16_t* base = static_cast<const uint16_t*>(base_v);
  a[0] = Load32(base + g * ld + 2 * t);
  a[1] = Load32(base + (g + 8) * ld + 2 * t);
  a[2] = Load32(base + g * ld + 2 * t + 8);
  a[3] = Load32(base + (g + 8) * ld + 2 * t + 8);
}

// Warp per query row (b, h, i): delta = dO_i . O_i in fp32, dO rounded as the other kernels see
// it (FlashAttention-2's D).
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    MmaDeltaKernel(const float* __restrict__ out, const float* __restrict__ dout,
                   AttentionShape s, float* __restrict__ delta) {
  const size_t row = static_cast<size_t>(blockIdx.x) * kMmaWarps + threadIdx.x / 32;
  if (row >= s.batch * s.num_heads * s.seq) return;  // the whole warp
  const int lane = static_cast<int>(threadIdx.x % 32);
  const size_t i = row % s.seq, h = (row / s.seq) % s.num_heads;
  const size_t b = row / (s.seq * s.num_heads);
  const size_t off = (b * s.seq + i) * s.q_stride + h * D;
  float part = 0.0f;
  for (int c = lane; c < D; c += 32) {
    part += out[off + c] * static_cast<float>(Round16<T>(dout[off + c]));
  }
  part = WarpSum(part);
  if (lane == 0) delta[row] = part;  // row = (b * num_heads + h) * seq + i
}

// Block (b * num_kv_heads + kv head, key tile): dK and dV of 64 keys. Overwrites dk and dv.
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    MmaBackwardKeyKernel(const float* __restrict__ q, const float* __restrict__ k,
                         const float* __restrict__ v, const float* __restrict__ lse,
                         const float* __restrict__ delta, const float* __restrict__ dout,
                         AttentionShape s, float* __restrict__ dk, float* __restrict__ dv) {
  using L = MmaSmem<T, D>;
  constexpr int RL = L::kRowLd, CL = L::kColLd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kMmaKeys * RL;
  T* qs = vs + kMmaKeys * RL;
  T* dos = qs + kMmaRows * RL;
  T* qts = dos + kMmaRows * RL;  // Q^T [D, 64]
  T* dots = qts + D * CL;        // dO^T
  float* lse_s = reinterpret_cast<float*>(dots + D * CL);  // times log2(e)
  float* delta_s = lse_s + kMmaRows;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = s.scale * kLog2e;

  const size_t b = blockIdx.x / s.num_kv_heads, kvh = blockIdx.x % s.num_kv_heads;
  const size_t tiles = (s.seq + kMmaRows - 1) / kMmaRows;
  const size_t kt = blockIdx.y;
  const size_t k0 = kt * kMmaKeys;
  const size_t key0 = k0 + static_cast<size_t>(warp) * 16 + static_cast<size_t>(g);
  const size_t key1 = key0 + 8;
  const size_t kv_base = b * s.seq * s.kv_stride + kvh * D;
  StageRows<T, D>(k + kv_base, s.kv_stride, k0, s.seq, ks, nullptr);
  StageRows<T, D>(v + kv_base, s.kv_stride, k0, s.seq, vs, nullptr);
  const T* kw = ks + warp * 16 * RL;  // the warp's 16 keys
  const T* vw = vs + warp * 16 * RL;

  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
  }

  for (size_t hq = 0; hq < s.group; ++hq) {
    const size_t h = kvh * s.group + hq;
    const size_t q_base = b * s.seq * s.q_stride + h * D;
    const size_t stat_base = (b * s.num_heads + h) * s.seq;
    for (size_t qt = kt; qt < tiles; ++qt) {
      const size_t q0 = qt * kMmaRows;
      __syncthreads();  // every warp is done with the previous query tile
      StageRows<T, D>(q + q_base, s.q_stride, q0, s.seq, qs, qts);
      StageRows<T, D>(dout + q_base, s.q_stride, q0, s.seq, dos, dots);
      for (int i = static_cast<int>(threadIdx.x); i < kMmaRows; i += kMmaThreads) {
        const size_t row = q0 + static_cast<size_t>(i);
        lse_s[i] = row < s.seq ? lse[stat_base + row] * kLog2e : 0.0f;
        delta_s[i] = row < s.seq ? delta[stat_base + row] : 0.0f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dO^T: [16 keys, 64 queries] each.
      float st[kMmaRows / 8][4], dpt[kMmaRows / 8][4];
#pragma unroll
      for (int n = 0; n < kMmaRows / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4], va[4];
        LoadA(kw + kk * 16, RL, g, t, ka);
        LoadA(vw + kk * 16, RL, g, t, va);
#pragma unroll
        for (int n = 0; n < kMmaRows / 8; ++n) {
          const T* qrow = qs + (n * 8 + g) * RL + kk * 16 + 2 * t;
          const T* drow = dos + (n * 8 + g) * RL + kk * 16 + 2 * t;
          Mma<T>(st[n], ka, Load32(qrow), Load32(qrow + 8));
          Mma<T>(dpt[n], va, Load32(drow), Load32(drow + 8));
        }
      }
      // P^T (a key after its query, or a query past seq, weighs 0) and dS^T = P^T o (dP^T - delta).
#pragma unroll
      for (int n = 0; n < kMmaRows / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int qi = n * 8 + 2 * t + j;
          const size_t query = q0 + static_cast<size_t>(qi);
          const bool live = query < s.seq;
          const float p0 = live && key0 <= query ? exp2f(st[n][j] * scale2 - lse_s[qi]) : 0.0f;
          const float p1 =
              live && key1 <= query ? exp2f(st[n][2 + j] * scale2 - lse_s[qi]) : 0.0f;
          dpt[n][j] = p0 * (dpt[n][j] - delta_s[qi]);
          dpt[n][2 + j] = p1 * (dpt[n][2 + j] - delta_s[qi]);
          st[n][j] = p0;
          st[n][2 + j] = p1;
        }
      }
      // dV += P^T dO and dK += dS^T Q, 16 queries at a time.
#pragma unroll
      for (int jq = 0; jq < kMmaRows / 16; ++jq) {
        uint32_t pa[4], da[4];
        AccumulatorsToA<T>(st[2 * jq], st[2 * jq + 1], pa);
        AccumulatorsToA<T>(dpt[2 * jq], dpt[2 * jq + 1], da);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const T* dcol = dots + (n * 8 + g) * CL + jq * 16 + 2 * t;
          const T* qcol = qts + (n * 8 + g) * CL + jq * 16 + 2 * t;
          Mma<T>(dv_acc[n], pa, Load32(dcol), Load32(dcol + 8));
          Mma<T>(dk_acc[n], da, Load32(qcol), Load32(qcol + 8));
        }
      }
    }
  }

#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const size_t col = static_cast<size_t>(n * 8 + 2 * t);
    if (key0 < s.seq) {
      *reinterpret_cast<float2*>(dk + kv_base + key0 * s.kv_stride + col) =
          make_float2(dk_acc[n][0] * s.scale, dk_acc[n][1] * s.scale);
      *reinterpret_cast<float2*>(dv + kv_base + key0 * s.kv_stride + col) =
          make_float2(dv_acc[n][0], dv_acc[n][1]);
    }
    if (key1 < s.seq) {
      *reinterpret_cast<float2*>(dk + kv_base + key1 * s.kv_stride + col) =
          make_float2(dk_acc[n][2] * s.scale, dk_acc[n][3] * s.scale);
      *reinterpret_cast<float2*>(dv + kv_base + key1 * s.kv_stride + col) =
          make_float2(dv_acc[n][2], dv_acc[n][3]);
    }
  }
}

// Block (b * num_heads + h, reversed query tile): dQ of 64 query rows. Overwrites dq.
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    MmaBackwardQueryKernel(const float* __restrict__ q, const float* __restrict__ k,
                           const float* __restrict__ v, const float* __restrict__ lse,
                           const float* __restrict__ delta, const float* __restrict__ dout,
                           AttentionShape s, float* __restrict__ dq) {
  using L = MmaSmem<T, D>;
  constexpr int RL = L::kRowLd, CL = L::kColLd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem);
  T* vs = ks + kMmaKeys * RL;
  T* kts = vs + kMmaKeys * RL;  // K^T [D, 64]
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale2 = s.scale * kLog2e;

  const size_t b = blockIdx.x / s.num_heads, h = blockIdx.x % s.num_heads, kvh = h / s.group;
  const size_t tiles = (s.seq + kMmaRows - 1) / kMmaRows;
  const size_t qt = tiles - 1 - blockIdx.y;  // the longest rows start first
  const size_t row0 = qt * kMmaRows + static_cast<size_t>(warp) * 16 + static_cast<size_t>(g);
  const size_t row1 = row0 + 8;
  const size_t q_base = b * s.seq * s.q_stride + h * D;
  const size_t kv_base = b * s.seq * s.kv_stride + kvh * D;
  const size_t stat_base = (b * s.num_heads + h) * s.seq;

  uint32_t qa[D / 16][4], da[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * t;
    qa[kk][0] = LoadPair<T>(q + q_base, s.q_stride, row0, s.seq, c);
    qa[kk][1] = LoadPair<T>(q + q_base, s.q_stride, row1, s.seq, c);
    qa[kk][2] = LoadPair<T>(q + q_base, s.q_stride, row0, s.seq, c + 8);
    qa[kk][3] = LoadPair<T>(q + q_base, s.q_stride, row1, s.seq, c + 8);
    da[kk][0] = LoadPair<T>(dout + q_base, s.q_stride, row0, s.seq, c);
    da[kk][1] = LoadPair<T>(dout + q_base, s.q_stride, row1, s.seq, c);
    da[kk][2] = LoadPair<T>(dout + q_base, s.q_stride, row0, s.seq, c + 8);
    da[kk][3] = LoadPair<T>(dout + q_base, s.q_stride, row1, s.seq, c + 8);
  }
  const float lse0 = row0 < s.seq ? lse[stat_base + row0] * kLog2e : 0.0f;
  const float lse1 = row1 < s.seq ? lse[stat_base + row1] * kLog2e : 0.0f;
  const float delta0 = row0 < s.seq ? delta[stat_base + row0] : 0.0f;
  const float delta1 = row1 < s.seq ? delta[stat_base + row1] : 0.0f;
  float dq_acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq_acc[n][0] = dq_acc[n][1] = dq_acc[n][2] = dq_acc[n][3] = 0.0f;

  for (size_t kt = 0; kt <= qt; ++kt) {
    const size_t k0 = kt * kMmaKeys;
    __syncthreads();  // every warp is done with the previous key tile
    StageRows<T, D>(k + kv_base, s.kv_stride, k0, s.seq, ks, kts);
    StageRows<T, D>(v + kv_base, s.kv_stride, k0, s.seq, vs, nullptr);
    __syncthreads();

    // S = Q K^T and dP = dO V^T: [16 queries, 64 keys] each.
    float sc[kMmaKeys / 8][4], dp[kMmaKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[n][e] = dp[n][e] = 0.0f;
      const T* krow = ks + (n * 8 + g) * RL + 2 * t;
      const T* vrow = vs + (n * 8 + g) * RL + 2 * t;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        Mma<T>(sc[n], qa[kk], Load32(krow + kk * 16), Load32(krow + kk * 16 + 8));
        Mma<T>(dp[n], da[kk], Load32(vrow + kk * 16), Load32(vrow + kk * 16 + 8));
      }
    }
    // dS = P o (dP - delta), P recomputed from lse (masked: 0), kept in sc.
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const size_t key = k0 + static_cast<size_t>(n * 8 + 2 * t + j);
        const float p0 = row0 < s.seq && key <= row0 ? exp2f(sc[n][j] * scale2 - lse0) : 0.0f;
        const float p1 =
            row1 < s.seq && key <= row1 ? exp2f(sc[n][2 + j] * scale2 - lse1) : 0.0f;
        sc[n][j] = p0 * (dp[n][j] - delta0);
        sc[n][2 + j] = p1 * (dp[n][2 + j] - delta1);
      }
    }
    // dQ += dS K, 16 keys at a time.
#pragma unroll
    for (int jk = 0; jk < kMmaKeys / 16; ++jk) {
      uint32_t dsa[4];
      AccumulatorsToA<T>(sc[2 * jk], sc[2 * jk + 1], dsa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const T* kcol = kts + (n * 8 + g) * CL + jk * 16 + 2 * t;
        Mma<T>(dq_acc[n], dsa, Load32(kcol), Load32(kcol + 8));
      }
    }
  }

#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const size_t col = static_cast<size_t>(n * 8 + 2 * t);
    if (row0 < s.seq) {
      *reinterpret_cast<float2*>(dq + q_base + row0 * s.q_stride + col) =
          make_float2(dq_acc[n][0] * s.scale, dq_acc[n][1] * s.scale);
    }
    if (row1 < s.seq) {
      *reinterpret_cast<float2*>(dq + q_base + row1 * s.q_stride + col) =
          make_float2(dq_acc[n][2] * s.scale, dq_acc[n][3] * s.scale);
    }
  }
}

}  // namespace

bool MmaAttentionSupports(DType dtype, const AttentionShape& s) {
  // The WMMA kernels' limits: the same dtypes, head dims and 64-row tiles. (The float2 / float4
  // loads need 16-byte rows, which the dispatch checks.)
  static_assert(kMmaRows == 64 && kMmaKeys == 64, "the WMMA kernels' tiles");
  return TensorCoreAttentionSupports(dtype, s);
}

OpError MmaAttentionForward(cudaStream_t stream, DType dtype, const AttentionShape& s,
                            const float* q, const float* k, const float* v, float* out,
                            float* lse) {
  constexpr const char* kOp = "AttentionForward";
  OpError error{};
  const bool taken = DispatchAttention16(dtype, s.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr size_t bytes = MmaSmem<T, D>::kForward;
    static_assert(bytes <= 48 * 1024, "within the default dynamic shared memory");
    const dim3 grid(static_cast<unsigned>(s.batch * s.num_heads),
                    static_cast<unsigned>((s.seq + kMmaRows - 1) / kMmaRows));
    MmaForwardKernel<T, D><<<grid, kMmaThreads, bytes, stream>>>(q, k, v, s, out, lse);
    error = LaunchResult(kOp);
  });
  return taken ? error
               : ArgumentError("the mma attention takes head_dim 64 or 128 in bf16 or fp16", kOp);
}

OpError MmaAttentionBackward(cudaStream_t stream, DType dtype, const AttentionShape& s,
                             const float* q, const float* k, const float* v, const float* out,
                             const float* lse, const float* dout, float* delta, float* dq,
                             float* dk, float* dv) {
  constexpr const char* kOp = "AttentionBackward";
  OpError error{};
  const bool taken = DispatchAttention16(dtype, s.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    const size_t rows = s.batch * s.num_heads * s.seq;
    MmaDeltaKernel<T, D>
        <<<static_cast<unsigned>((rows + kMmaWarps - 1) / kMmaWarps), kMmaThreads, 0, stream>>>(
            out, dout, s, delta);
    error = LaunchResult(kOp);
    if (!error.ok()) return;
    using L = MmaSmem<T, D>;
    error = AllowSharedMemory(MmaBackwardKeyKernel<T, D>, L::kKeys, kOp);
    if (!error.ok()) return;
    error = AllowSharedMemory(MmaBackwardQueryKernel<T, D>, L::kQueries, kOp);
    if (!error.ok()) return;
    const unsigned tiles = static_cast<unsigned>((s.seq + kMmaRows - 1) / kMmaRows);
    MmaBackwardKeyKernel<T, D>
        <<<dim3(static_cast<unsigned>(s.batch * s.num_kv_heads), tiles), kMmaThreads, L::kKeys,
           stream>>>(q, k, v, lse, delta, dout, s, dk, dv);
    error = LaunchResult(kOp);
    if (!error.ok()) return;
    MmaBackwardQueryKernel<T, D>
        <<<dim3(static_cast<unsigned>(s.batch * s.num_heads), tiles), kMmaThreads, L::kQueries,
           stream>>>(q, k, v, lse, delta, dout, s, dq);
    error = LaunchResult(kOp);
  });
  return taken ? error
               : ArgumentError("the mma attention takes head_dim 64 or 128 in bf16 or fp16", kOp);
}

}  // namespace strata::model::cuda::detail
