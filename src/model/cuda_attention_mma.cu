// Causal grouped-query attention forward on the tensor cores through register-level mma.sync
// (m16n8k16, bf16 or fp16 inputs, fp32 accumulation): the kernel STRATA_ATTENTION=mma selects
// (cuda_ops.cu). Same contract as the WMMA kernel of cuda_attention_tc.cu (q, k, v and the
// probabilities rounded to the dtype, softmax statistics and the output fp32), without its
// shared-memory round trips: the score tile, the probabilities and the running output stay in
// registers.
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

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "model/cuda_ops_internal.cuh"

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

template <typename T>
__device__ inline T Round16(float x);
template <>
__device__ inline __nv_bfloat16 Round16<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half Round16<__half>(float x) {
  return __float2half_rn(x);
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

template <typename T, int D>
struct MmaSmem {
  static constexpr int kKLd = D + kMmaPad;         // K tile [64, D], row-major
  static constexpr int kVLd = kMmaKeys + kMmaPad;  // V tile transposed [D, 64]
  static constexpr size_t kBytes =
      (size_t{kMmaKeys} * kKLd + size_t{D} * kVLd) * sizeof(T);
};

// K rows k0.. into ks (row-major) and V rows into vt (transposed), rounded; zeros past seq.
// Each thread takes groups of four consecutive floats (coalesced across the block).
template <typename T, int D>
__device__ inline void LoadKeyTile(const float* __restrict__ kb, const float* __restrict__ vb,
                                   size_t stride, size_t k0, size_t seq, T* __restrict__ ks,
                                   T* __restrict__ vt) {
  using L = MmaSmem<T, D>;
  constexpr int kQuads = D / 4;
  for (int idx = static_cast<int>(threadIdx.x); idx < kMmaKeys * kQuads; idx += kMmaThreads) {
    const int r = idx / kQuads, c = (idx % kQuads) * 4;
    const size_t row = k0 + static_cast<size_t>(r);
    float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
    if (row < seq) {
      kv = *reinterpret_cast<const float4*>(kb + row * stride + c);
      vv = *reinterpret_cast<const float4*>(vb + row * stride + c);
    }
    T* kd = ks + r * L::kKLd + c;
    kd[0] = Round16<T>(kv.x);
    kd[1] = Round16<T>(kv.y);
    kd[2] = Round16<T>(kv.z);
    kd[3] = Round16<T>(kv.w);
    vt[(c + 0) * L::kVLd + r] = Round16<T>(vv.x);
    vt[(c + 1) * L::kVLd + r] = Round16<T>(vv.y);
    vt[(c + 2) * L::kVLd + r] = Round16<T>(vv.z);
    vt[(c + 3) * L::kVLd + r] = Round16<T>(vv.w);
  }
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
  T* vt = ks + kMmaKeys * L::kKLd;
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
    LoadKeyTile<T, D>(kb, vb, s.kv_stride, k0, s.seq, ks, vt);
    __syncthreads();

    // S = Q K^T: eight 16 x 8 tiles of keys.
    float sc[kMmaKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kMmaKeys / 8; ++n) {
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
      const T* krow = ks + (n * 8 + g) * L::kKLd + 2 * t;
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
      const uint32_t pa[4] = {Pack<T>(sc[2 * j][0], sc[2 * j][1]),
                              Pack<T>(sc[2 * j][2], sc[2 * j][3]),
                              Pack<T>(sc[2 * j + 1][0], sc[2 * j + 1][1]),
                              Pack<T>(sc[2 * j + 1][2], sc[2 * j + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const T* vrow = vt + (n * 8 + g) * L::kVLd + j * 16 + 2 * t;
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

template <typename Fn>
bool DispatchMma(DType dtype, size_t head_dim, Fn&& fn) {
  if (head_dim != 64 && head_dim != 128) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  auto with_dim = [&](auto tag) {
    if (head_dim == 64) {
      fn(tag, std::integral_constant<int, 64>{});
    } else {
      fn(tag, std::integral_constant<int, 128>{});
    }
  };
  if (dtype == DType::kBF16) {
    with_dim(__nv_bfloat16{});
  } else {
    with_dim(__half{});
  }
  return true;
}

}  // namespace

bool MmaAttentionSupports(DType dtype, const AttentionShape& s) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (s.head_dim != 64 && s.head_dim != 128) return false;
  // float2 / float4 loads: rows of whole heads keep 16-byte alignment (the strides are
  // multiples of 64 floats).
  const size_t tiles = (s.seq + kMmaRows - 1) / kMmaRows;
  return tiles <= 65535 && s.batch * s.num_heads <= static_cast<size_t>(INT_MAX);
}

OpError MmaAttentionForward(cudaStream_t stream, DType dtype, const AttentionShape& s,
                            const float* q, const float* k, const float* v, float* out,
                            float* lse) {
  constexpr const char* kOp = "AttentionForward";
  OpError error{};
  const bool taken = DispatchMma(dtype, s.head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr size_t bytes = MmaSmem<T, D>::kBytes;
    static_assert(bytes <= 48 * 1024, "within the default dynamic shared memory");
    const dim3 grid(static_cast<unsigned>(s.batch * s.num_heads),
                    static_cast<unsigned>((s.seq + kMmaRows - 1) / kMmaRows));
    MmaForwardKernel<T, D><<<grid, kMmaThreads, bytes, stream>>>(q, k, v, s, out, lse);
    error = LaunchResult(kOp);
  });
  return taken ? error
               : ArgumentError("the mma attention takes head_dim 64 or 128 in bf16 or fp16", kOp);
}

}  // namespace strata::model::cuda::detail
