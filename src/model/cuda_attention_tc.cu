// Causal grouped-query attention on the tensor cores, for 16-bit runs (cuda_ops.h,
// AttentionForward with a bf16 or fp16 precision).
//
// The blocking is FlashAttention-2's: a block owns 64 query rows (forward, dQ) or 64 key rows
// (dK, dV), four warps of 16 rows each, and streams the other side through shared memory in
// tiles of 64 rows. Products run on WMMA 16x16x16 fragments with fp32 accumulation; the inputs
// (q, k, v, dO, and the probabilities P and dS that feed the second product) are rounded to the
// 16-bit dtype as they enter shared memory. Softmax statistics and every accumulator stay fp32.
// No [seq, seq] matrix exists: each warp holds a [16, 64] score tile at a time.
//
// Activations (q, k, v, out, dO and the gradients) are fp32 or 16-bit in the attention's dtype
// (the kernels' A: float, or T itself). 16-bit ones enter shared memory as they are (the rounding
// is the identity); the output and the gradients are stored in A, rounded once from fp32.
//
// WMMA's fragment layout is opaque, so each score tile goes through the warp's shared memory
// (store, element-wise work, reload): simpler than register-level mma.sync and independent of
// the architecture's layout, at some cost in shared-memory traffic.
//
// The backward does not use atomics (Strata's runs are bit-reproducible): one kernel per key
// tile computes dK and dV over every query tile and head of its kv group; another per query
// tile computes dQ over every key tile. Both recompute P from the forward's log-sum-exp.
//
// Padding: rows past `seq` load as zeros and are masked out of every softmax and product, and
// nothing is written for them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "model/cuda_ops_internal.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the tensor-core attention needs sm_80 or newer (bf16 WMMA): set CMAKE_CUDA_ARCHITECTURES"
#endif

namespace strata::model::cuda::detail {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kTile = 64;                  // rows per block; rows per streamed tile
constexpr int kWarps = 4;                  // each owns 16 of the block's rows
constexpr int kThreads = kWarps * 32;      // per block
constexpr int kWarpRows = kTile / kWarps;  // 16
constexpr int kFrag = 16;                  // WMMA m = n = k for 16-bit inputs
constexpr int kPad = 8;                    // elements added to each shared row (spreads banks;
                                           // keeps every fragment 32-byte aligned)
constexpr int kScoreLd = kTile + kPad;     // row stride of a warp's [16, 64] score tiles
// The forward's fp32 score tile is read a row per lane pair (below): with a stride of 68 floats
// the 32 lanes touch 16 banks, two ways each, where 72 would put 8 lanes on one bank.
constexpr int kForwardScoreLd = kTile + 4;

static_assert(kWarpRows == kFrag, "a warp owns one fragment's rows");

// Rounding to the storage dtype.
template <typename T>
__device__ inline T Round(float x) {
  return Round16<T>(x);
}

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major>;
template <typename T>
using FragBRow = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::row_major>;
template <typename T>
using FragBCol = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

// Shared memory of the three kernels; every piece is a multiple of 128 bytes, so each starts
// 128-byte aligned.
template <typename T, int D>
struct Smem {
  static constexpr int kLd = D + kPad;  // row stride of a [64, D] tile
  static constexpr size_t kTileBytes = size_t{kTile} * kLd * sizeof(T);
  static constexpr size_t kScoreF32 = size_t{kWarpRows} * kScoreLd * sizeof(float);
  static constexpr size_t kScore16 = size_t{kWarpRows} * kScoreLd * sizeof(T);
  static constexpr size_t kRowF32 = size_t{kWarpRows} * kLd * sizeof(float);
  static constexpr size_t kStats = 2 * kTile * sizeof(float);  // lse, delta of a query tile

  // Forward: Q, K, V tiles; per warp S (fp32), P (16-bit), O (fp32, the running output).
  static constexpr size_t kForwardWarp = kScoreF32 + kScore16 + kRowF32;
  static constexpr size_t kForward = 3 * kTileBytes + kWarps * kForwardWarp;
  // Backward: two row tiles and two streamed tiles; lse and delta; per warp S and dP (fp32),
  // P and dS (16-bit). S and dP, adjacent, stage the warp's results on the way out.
  static constexpr size_t kBackwardWarp = 2 * kScoreF32 + 2 * kScore16;
  static constexpr size_t kBackward = 4 * kTileBytes + kStats + kWarps * kBackwardWarp;

  static_assert(kTileBytes % 128 == 0 && kScoreF32 % 128 == 0 && kScore16 % 128 == 0 &&
                    kRowF32 % 128 == 0 && kStats % 128 == 0,
                "shared-memory pieces keep 128-byte alignment");
  static_assert(2 * kScoreF32 >= kRowF32, "S and dP together stage a warp's [16, D] result");
};

// dst[r, c] = src[(first + r) * stride + c] rounded, for r < 64 and c < D; zero rows past seq.
// From fp32: each thread takes kTile * D / 4 / kThreads groups of four consecutive floats
// (coalesced across the block) and loads 8 groups before it stores any (one memory latency per 8
// groups, where a load-convert-store loop waits once per load), as 16-byte loads where the
// source rows allow (every Llama shape: rows of whole heads).
template <typename T, int D>
__device__ inline void LoadTile(const float* __restrict__ src, size_t stride, size_t first,
                                size_t seq, T* __restrict__ dst) {
  constexpr int kLd = Smem<T, D>::kLd;
  constexpr int kQuads = D / 4;  // groups of four floats per row
  constexpr int kPerThread = kTile * kQuads / kThreads;
  static_assert(kTile * kQuads % kThreads == 0, "the tile divides among the threads");
  const bool vector =
      ((reinterpret_cast<uintptr_t>(src) | (stride * sizeof(float))) % sizeof(float4)) == 0;
  // In batches of at most 8 groups (32 registers): the backward kernels load while holding two
  // [16, D] accumulators, and D = 128 would spill with all 16 in flight.
  constexpr int kBatch = kPerThread < 8 ? kPerThread : 8;
  static_assert(kPerThread % kBatch == 0, "whole batches");
#pragma unroll 1
  for (int first_i = 0; first_i < kPerThread; first_i += kBatch) {
    float4 vals[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + (first_i + i) * kThreads;
      const int r = idx / kQuads, c = (idx % kQuads) * 4;
      const size_t row = first + static_cast<size_t>(r);
      vals[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (row < seq) {
        const float* p = src + row * stride + c;
        if (vector) {
          vals[i] = *reinterpret_cast<const float4*>(p);
        } else {
          vals[i] = make_float4(p[0], p[1], p[2], p[3]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + (first_i + i) * kThreads;
      const int r = idx / kQuads, c = (idx % kQuads) * 4;
      T* d = dst + r * kLd + c;
      d[0] = Round<T>(vals[i].x);
      d[1] = Round<T>(vals[i].y);
      d[2] = Round<T>(vals[i].z);
      d[3] = Round<T>(vals[i].w);
    }
  }
}

// The same from 16-bit activations already in the tile's dtype (the rounding is the identity):
// groups of eight elements (16 bytes) copied as they are, every group of the thread loaded before
// any is stored; element by element where the source rows are not 16-byte aligned.
template <typename T, int D>
__device__ inline void LoadTile(const T* __restrict__ src, size_t stride, size_t first, size_t seq,
                                T* __restrict__ dst) {
  constexpr int kLd = Smem<T, D>::kLd;
  constexpr int kOcts = D / 8;  // groups of eight elements per row
  constexpr int kPerThread = kTile * kOcts / kThreads;
  static_assert(kTile * kOcts % kThreads == 0, "the tile divides among the threads");
  static_assert(kPerThread <= 8, "at most 32 registers of loads in flight");
  static_assert(sizeof(T) == 2 && (kLd * sizeof(T)) % sizeof(uint4) == 0,
                "every group of a shared row is 16-byte aligned");
  const bool vector =
      ((reinterpret_cast<uintptr_t>(src) | (stride * sizeof(T))) % sizeof(uint4)) == 0;
  if (vector) {
    uint4 vals[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = idx / kOcts, c = (idx % kOcts) * 8;
      const size_t row = first + static_cast<size_t>(r);
      vals[i] = make_uint4(0u, 0u, 0u, 0u);  // +0 in either 16-bit format
      if (row < seq) vals[i] = *reinterpret_cast<const uint4*>(src + row * stride + c);
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = idx / kOcts, c = (idx % kOcts) * 8;
      *reinterpret_cast<uint4*>(dst + r * kLd + c) = vals[i];
    }
    return;
  }
  const T zero = Round<T>(0.0f);
  for (int idx = static_cast<int>(threadIdx.x); idx < kTile * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    const size_t row = first + static_cast<size_t>(r);
    dst[r * kLd + c] = row < seq ? src[row * stride + c] : zero;
  }
}

// out[16, 64] (fp32, ld OutLd) = A[16, D] B[64, D]^T, A and B row-major with ld kLd.
template <typename T, int D, int OutLd = kScoreLd>
__device__ inline void ScoreTile(const T* a, const T* b, float* out) {
  constexpr int kLd = Smem<T, D>::kLd;
#pragma unroll
  for (int n = 0; n < kTile / kFrag; ++n) {
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < D; kk += kFrag) {
      FragA<T> fa;
      FragBCol<T> fb;  // B^T's column n*16+j is B's row n*16+j
      wmma::load_matrix_sync(fa, a + kk, kLd);
      wmma::load_matrix_sync(fb, b + n * kFrag * kLd + kk, kLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * kFrag, acc, OutLd, wmma::mem_row_major);
  }
}

// acc[n] += A[16, 64] B[64, D] (column block n), A with ld kScoreLd, B row-major with ld kLd.
template <typename T, int D>
__device__ inline void AccumulateProduct(const T* a, const T* b, FragAcc (&acc)[D / kFrag]) {
  constexpr int kLd = Smem<T, D>::kLd;
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) {
#pragma unroll
    for (int kk = 0; kk < kTile; kk += kFrag) {
      FragA<T> fa;
      FragBRow<T> fb;
      wmma::load_matrix_sync(fa, a + kk, kScoreLd);
      wmma::load_matrix_sync(fb, b + kk * kLd + n * kFrag, kLd);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// Writes a warp's [16, D] result: dst row `first + r` (stride `stride`) = scale * acc row r,
// rounded to A, for the rows below seq. `stage` is the warp's fp32 shared scratch of 16 x kLd.
template <typename T, int D, typename A>
__device__ inline void StoreRows(FragAcc (&acc)[D / kFrag], float* stage, float scale,
                                 A* __restrict__ dst, size_t stride, size_t first, size_t seq,
                                 unsigned lane) {
  constexpr int kLd = Smem<T, D>::kLd;
  __syncwarp();
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n)
    wmma::store_matrix_sync(stage + n * kFrag, acc[n], kLd, wmma::mem_row_major);
  __syncwarp();
  for (int r = 0; r < kWarpRows; ++r) {
    const size_t row = first + static_cast<size_t>(r);
    if (row >= seq) break;
    for (int c = static_cast<int>(lane); c < D; c += 32)
      dst[row * stride + c] = ActStore<A>(scale * stage[r * kLd + c]);
  }
  __syncwarp();
}

// ---- forward ------------------------------------------------------------------------------------

// Block (b * num_heads + h, reversed query tile): O and lse of 64 query rows.
template <typename T, int D, typename A>
__global__ void __launch_bounds__(kThreads)
    TcForwardKernel(const A* __restrict__ q, const A* __restrict__ k, const A* __restrict__ v,
                    AttentionShape s, A* __restrict__ out, float* __restrict__ lse) {
  using L = Smem<T, D>;
  constexpr int kLd = L::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = reinterpret_cast<T*>(smem + L::kTileBytes);
  T* vs = reinterpret_cast<T*>(smem + 2 * L::kTileBytes);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = smem + 3 * L::kTileBytes + warp * L::kForwardWarp;
  float* scores = reinterpret_cast<float*>(mine);
  T* probs = reinterpret_cast<T*>(mine + L::kScoreF32);
  float* o = reinterpret_cast<float*>(mine + L::kScoreF32 + L::kScore16);

  const size_t b = blockIdx.x / s.num_heads, h = blockIdx.x % s.num_heads, g = h / s.group;
  const size_t tiles = (s.seq + kTile - 1) / kTile;
  const size_t qt = tiles - 1 - blockIdx.y;  // the longest rows start first
  const size_t q0 = qt * kTile;
  const size_t w0 = q0 + warp * kWarpRows;  // the warp's first query row
  const A* kb = k + b * s.seq * s.kv_stride + g * D;
  const A* vb = v + b * s.seq * s.kv_stride + g * D;

  LoadTile<T, D>(q + b * s.seq * s.q_stride + h * D, s.q_stride, q0, s.seq, qs);
  for (int i = static_cast<int>(lane); i < kWarpRows * kLd; i += 32)
    o[i] = 0.0f;
  // The online softmax works a row per lane pair: lanes 2r and 2r + 1 own row r of the warp's
  // 16 (keys of even and odd index in each tile), so a row's max and sum take one shuffle, not a
  // warp-wide reduction per row. Both lanes of a pair hold the row's running max and sum.
  const int my_row = static_cast<int>(lane) / 2;
  const int parity = static_cast<int>(lane) % 2;
  const size_t row = w0 + static_cast<size_t>(my_row);
  float m = -INFINITY, l = 0.0f;

  for (size_t kt = 0; kt <= qt; ++kt) {
    const size_t k0 = kt * kTile;
    __syncthreads();  // every warp is done with the previous K and V
    LoadTile<T, D>(kb, s.kv_stride, k0, s.seq, ks);
    LoadTile<T, D>(vb, s.kv_stride, k0, s.seq, vs);
    __syncthreads();

    ScoreTile<T, D, kForwardScoreLd>(qs + warp * kWarpRows * kLd, ks, scores);
    __syncwarp();
    // This lane's 32 keys of the tile: k0 + 2j + parity. Masked keys (after the row, or past
    // seq) score -inf, so that they weigh 0.
    float x[kTile / 2];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kTile / 2; ++j) {
      const int col = 2 * j + parity;
      const size_t key = k0 + static_cast<size_t>(col);
      x[j] = key <= row && key < s.seq ? scores[my_row * kForwardScoreLd + col] * s.scale
                                       : -INFINITY;
      tile_max = fmaxf(tile_max, x[j]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float base = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kTile / 2; ++j) {
      const float p = expf(x[j] - base);  // 0 for a masked key
      probs[my_row * kScoreLd + 2 * j + parity] = Round<T>(p);
      sum += p;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float correction = expf(m - base);  // 0 while m is -inf
    l = l * correction + sum;
    m = m_new;
    __syncwarp();
    // Rescale the running output: lanes across the columns, each row's correction from its pair.
#pragma unroll
    for (int r = 0; r < kWarpRows; ++r) {
      const float c_r = __shfl_sync(0xffffffffu, correction, 2 * r);
      for (int c = static_cast<int>(lane); c < D; c += 32)
        o[r * kLd + c] *= c_r;
    }
    __syncwarp();
    // O += P V, through the accumulator fragments.
#pragma unroll
    for (int n = 0; n < D / kFrag; ++n) {
      FragAcc acc;
      wmma::load_matrix_sync(acc, o + n * kFrag, kLd, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kTile; kk += kFrag) {
        FragA<T> fa;
        FragBRow<T> fb;
        wmma::load_matrix_sync(fa, probs + kk, kScoreLd);
        wmma::load_matrix_sync(fb, vs + kk * kLd + n * kFrag, kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o + n * kFrag, acc, kLd, wmma::mem_row_major);
    }
    __syncwarp();
  }

  A* ob = out + b * s.seq * s.q_stride + h * D;
  float* lb = lse + (b * s.num_heads + h) * s.seq;
  const float inv = 1.0f / l;
  if (parity == 0 && row < s.seq) lb[row] = m + logf(l);
#pragma unroll
  for (int r = 0; r < kWarpRows; ++r) {
    const float inv_r = __shfl_sync(0xffffffffu, inv, 2 * r);
    const size_t out_row = w0 + static_cast<size_t>(r);
    if (out_row >= s.seq) break;  // uniform
    for (int c = static_cast<int>(lane); c < D; c += 32)
      ob[out_row * s.q_stride + c] = ActStore<A>(o[r * kLd + c] * inv_r);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// Warp per query row (b, h, i): delta = dO_i . O_i in fp32 (FlashAttention-2's D), with dO
// rounded as the other kernels see it, so that delta matches rowsum(P o dP) as they compute it.
template <typename T, int D, typename A>
__global__ void __launch_bounds__(kThreads)
    TcDeltaKernel(const A* __restrict__ out, const A* __restrict__ dout, AttentionShape s,
                  float* __restrict__ delta) {
  const size_t row = static_cast<size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= s.batch * s.num_heads * s.seq) return;  // the whole warp
  const unsigned lane = threadIdx.x % 32;
  const size_t i = row % s.seq, h = (row / s.seq) % s.num_heads;
  const size_t b = row / (s.seq * s.num_heads);
  const size_t off = (b * s.seq + i) * s.q_stride + h * D;
  float part = 0.0f;
  for (int c = static_cast<int>(lane); c < D; c += 32)
    part += ActLoad(out[off + c]) * static_cast<float>(Round<T>(ActLoad(dout[off + c])));
  part = WarpSum(part);
  if (lane == 0) delta[row] = part;  // row = (b * num_heads + h) * seq + i
}

// The backward kernels' shared memory: the block's own rows (K and V, or Q and dO), the streamed
// tile (Q and dO, or K and V), the streamed or own query rows' lse and delta, and this warp's
// score tiles.
template <typename T, int D>
struct BackwardView {
  T* own[2];
  T* streamed[2];
  float* lse;
  float* delta;
  float* s;   // S (or S^T), fp32; with dp after it, the staging of the results
  float* dp;  // dP (or dP^T), fp32
  T* p;       // P (or P^T), rounded
  T* ds;      // dS (or dS^T), rounded
};

template <typename T, int D>
__device__ inline BackwardView<T, D> CarveBackward(unsigned char* smem, unsigned warp) {
  using L = Smem<T, D>;
  BackwardView<T, D> v;
  for (int i = 0; i < 2; ++i) {
    v.own[i] = reinterpret_cast<T*>(smem + i * L::kTileBytes);
    v.streamed[i] = reinterpret_cast<T*>(smem + (2 + i) * L::kTileBytes);
  }
  v.lse = reinterpret_cast<float*>(smem + 4 * L::kTileBytes);
  v.delta = v.lse + kTile;
  unsigned char* mine = smem + 4 * L::kTileBytes + L::kStats + warp * L::kBackwardWarp;
  v.s = reinterpret_cast<float*>(mine);
  v.dp = reinterpret_cast<float*>(mine + L::kScoreF32);
  v.p = reinterpret_cast<T*>(mine + 2 * L::kScoreF32);
  v.ds = reinterpret_cast<T*>(mine + 2 * L::kScoreF32 + L::kScore16);
  return v;
}

// lse and delta of the query rows q0 .. q0 + 63 (0 past seq; those rows are masked anyway).
__device__ inline void LoadStats(const float* __restrict__ lse, const float* __restrict__ delta,
                                 size_t stat_base, size_t q0, size_t seq, float* lse_s,
                                 float* delta_s) {
  for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kThreads) {
    const size_t row = q0 + static_cast<size_t>(i);
    lse_s[i] = row < seq ? lse[stat_base + row] : 0.0f;
    delta_s[i] = row < seq ? delta[stat_base + row] : 0.0f;
  }
}

// Block (b * num_kv_heads + g, key tile): dK and dV of 64 key rows, over the query heads of
// group g and the query tiles at or after the key tile. Overwrites dk and dv.
template <typename T, int D, typename A>
__global__ void __launch_bounds__(kThreads)
    TcBackwardKeyKernel(const A* __restrict__ q, const A* __restrict__ k, const A* __restrict__ v,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        const A* __restrict__ dout, AttentionShape s, A* __restrict__ dk,
                        A* __restrict__ dv) {
  constexpr int kLd = Smem<T, D>::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BackwardView<T, D> view = CarveBackward<T, D>(smem, warp);
  T* ks = view.own[0];
  T* vs = view.own[1];
  T* qs = view.streamed[0];
  T* dos = view.streamed[1];
  float* lse_s = view.lse;
  float* delta_s = view.delta;
  float* st = view.s;     // S^T: [key, query]
  float* dpt = view.dp;   // dP^T
  T* pt = view.p;         // P^T, rounded
  T* dst_ = view.ds;      // dS^T, rounded

  const size_t b = blockIdx.x / s.num_kv_heads, g = blockIdx.x % s.num_kv_heads;
  const size_t tiles = (s.seq + kTile - 1) / kTile;
  const size_t kt = blockIdx.y;  // the longest columns start first
  const size_t k0 = kt * kTile;
  const size_t w0 = k0 + warp * kWarpRows;  // the warp's first key row
  const size_t kv_base = b * s.seq * s.kv_stride + g * D;
  LoadTile<T, D>(k + kv_base, s.kv_stride, k0, s.seq, ks);
  LoadTile<T, D>(v + kv_base, s.kv_stride, k0, s.seq, vs);

  FragAcc dk_acc[D / kFrag], dv_acc[D / kFrag];
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) {
    wmma::fill_fragment(dk_acc[n], 0.0f);
    wmma::fill_fragment(dv_acc[n], 0.0f);
  }

  for (size_t h = g * s.group; h < (g + 1) * s.group; ++h) {
    const size_t q_base = b * s.seq * s.q_stride + h * D;
    const size_t stat_base = (b * s.num_heads + h) * s.seq;
    for (size_t qt = kt; qt < tiles; ++qt) {
      const size_t q0 = qt * kTile;
      __syncthreads();  // every warp is done with the previous Q, dO and statistics
      LoadTile<T, D>(q + q_base, s.q_stride, q0, s.seq, qs);
      LoadTile<T, D>(dout + q_base, s.q_stride, q0, s.seq, dos);
      LoadStats(lse, delta, stat_base, q0, s.seq, lse_s, delta_s);
      __syncthreads();

      ScoreTile<T, D>(ks + warp * kWarpRows * kLd, qs, st);   // S^T = K_w Q^T
      ScoreTile<T, D>(vs + warp * kWarpRows * kLd, dos, dpt);  // dP^T = V_w dO^T
      __syncwarp();
      // P^T and dS^T; lane j holds queries q0 + j and q0 + j + 32.
      const float lse0 = lse_s[lane], lse1 = lse_s[lane + 32];
      const float delta0 = delta_s[lane], delta1 = delta_s[lane + 32];
      const size_t query0 = q0 + lane, query1 = query0 + 32;
#pragma unroll 4
      for (int r = 0; r < kWarpRows; ++r) {
        const size_t key = w0 + static_cast<size_t>(r);
        const bool ok0 = query0 < s.seq && key <= query0;
        const bool ok1 = query1 < s.seq && key <= query1;
        const int i0 = r * kScoreLd + static_cast<int>(lane), i1 = i0 + 32;
        const float p0 = ok0 ? expf(st[i0] * s.scale - lse0) : 0.0f;
        const float p1 = ok1 ? expf(st[i1] * s.scale - lse1) : 0.0f;
        pt[i0] = Round<T>(p0);
        pt[i1] = Round<T>(p1);
        dst_[i0] = Round<T>(ok0 ? p0 * (dpt[i0] - delta0) : 0.0f);
        dst_[i1] = Round<T>(ok1 ? p1 * (dpt[i1] - delta1) : 0.0f);
      }
      __syncwarp();
      AccumulateProduct<T, D>(pt, dos, dv_acc);   // dV_w += P^T dO
      AccumulateProduct<T, D>(dst_, qs, dk_acc);  // dK_w += dS^T Q
    }
  }

  StoreRows<T, D, A>(dv_acc, st, 1.0f, dv + kv_base, s.kv_stride, w0, s.seq, lane);
  StoreRows<T, D, A>(dk_acc, st, s.scale, dk + kv_base, s.kv_stride, w0, s.seq, lane);
}

// Block (b * num_heads + h, reversed query tile): dQ of 64 query rows over the key tiles at or
// before it.
template <typename T, int D, typename A>
__global__ void __launch_bounds__(kThreads)
    TcBackwardQueryKernel(const A* __restrict__ q, const A* __restrict__ k, const A* __restrict__ v,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          const A* __restrict__ dout, AttentionShape s, A* __restrict__ dq) {
  constexpr int kLd = Smem<T, D>::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BackwardView<T, D> view = CarveBackward<T, D>(smem, warp);
  T* qs = view.own[0];
  T* dos = view.own[1];
  T* ks = view.streamed[0];
  T* vs = view.streamed[1];
  float* lse_s = view.lse;
  float* delta_s = view.delta;
  float* sc = view.s;   // S: [query, key]
  float* dp = view.dp;  // dP
  T* ds = view.ds;      // dS, rounded

  const size_t b = blockIdx.x / s.num_heads, h = blockIdx.x % s.num_heads, g = h / s.group;
  const size_t tiles = (s.seq + kTile - 1) / kTile;
  const size_t qt = tiles - 1 - blockIdx.y;
  const size_t q0 = qt * kTile;
  const size_t w0 = q0 + warp * kWarpRows;  // the warp's first query row
  const size_t q_base = b * s.seq * s.q_stride + h * D;
  const size_t kv_base = b * s.seq * s.kv_stride + g * D;
  const size_t stat_base = (b * s.num_heads + h) * s.seq;
  LoadTile<T, D>(q + q_base, s.q_stride, q0, s.seq, qs);
  LoadTile<T, D>(dout + q_base, s.q_stride, q0, s.seq, dos);
  LoadStats(lse, delta, stat_base, q0, s.seq, lse_s, delta_s);

  FragAcc dq_acc[D / kFrag];
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n)
    wmma::fill_fragment(dq_acc[n], 0.0f);

  for (size_t kt = 0; kt <= qt; ++kt) {
    const size_t k0 = kt * kTile;
    __syncthreads();  // the first time: Q, dO and the statistics are in; later: K, V are free
    LoadTile<T, D>(k + kv_base, s.kv_stride, k0, s.seq, ks);
    LoadTile<T, D>(v + kv_base, s.kv_stride, k0, s.seq, vs);
    __syncthreads();

    ScoreTile<T, D>(qs + warp * kWarpRows * kLd, ks, sc);   // S = Q_w K^T
    ScoreTile<T, D>(dos + warp * kWarpRows * kLd, vs, dp);  // dP = dO_w V^T
    __syncwarp();
    const size_t key0 = k0 + lane, key1 = key0 + 32;
#pragma unroll 4
    for (int r = 0; r < kWarpRows; ++r) {
      const size_t row = w0 + static_cast<size_t>(r);
      const float lse_r = lse_s[warp * kWarpRows + r];
      const float delta_r = delta_s[warp * kWarpRows + r];
      const bool ok0 = row < s.seq && key0 <= row;
      const bool ok1 = row < s.seq && key1 <= row;
      const int i0 = r * kScoreLd + static_cast<int>(lane), i1 = i0 + 32;
      const float p0 = ok0 ? expf(sc[i0] * s.scale - lse_r) : 0.0f;
      const float p1 = ok1 ? expf(sc[i1] * s.scale - lse_r) : 0.0f;
      ds[i0] = Round<T>(ok0 ? p0 * (dp[i0] - delta_r) : 0.0f);
      ds[i1] = Round<T>(ok1 ? p1 * (dp[i1] - delta_r) : 0.0f);
    }
    __syncwarp();
    AccumulateProduct<T, D>(ds, ks, dq_acc);  // dQ_w += dS K
  }

  StoreRows<T, D, A>(dq_acc, sc, s.scale, dq + q_base, s.q_stride, w0, s.seq, lane);
}

// ---- launches -----------------------------------------------------------------------------------

size_t Tiles(const AttentionShape& s) {
  return (s.seq + kTile - 1) / kTile;
}

}  // namespace

bool TensorCoreAttentionSupports(DType dtype, const AttentionShape& s) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (s.head_dim != 64 && s.head_dim != 128) return false;
  const size_t tiles = Tiles(s);
  return tiles <= 65535 && s.batch * s.num_heads <= static_cast<size_t>(INT_MAX);
}

namespace {

// Calls fn(T{}, D, A{}) for the tiles' dtype T and head_dim D (DispatchAttention16) and the
// activations' element type A (float, or T itself); false (and no call) for any other case.
template <typename Fn>
bool DispatchTensorCores(DType dtype, DType act, size_t head_dim, Fn&& fn) {
  if (act != DType::kF32 && act != dtype) return false;
  return DispatchAttention16(dtype, head_dim, [&](auto tag, auto dim) {
    if (act == DType::kF32) {
      fn(tag, dim, float{});
    } else {
      fn(tag, dim, tag);
    }
  });
}

constexpr const char* kNotTaken =
    "the tensor-core attention takes head_dim 64 or 128 in bf16 or fp16, with fp32 activations "
    "or activations of that dtype";

}  // namespace

OpError TensorCoreAttentionForward(cudaStream_t stream, DType dtype, DType act,
                                   const AttentionShape& s, const void* q, const void* k,
                                   const void* v, void* out, float* lse) {
  constexpr const char* kOp = "AttentionForward";
  OpError error{};
  const bool taken = DispatchTensorCores(dtype, act, s.head_dim, [&](auto tag, auto dim, auto a) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    using A = decltype(a);
    constexpr size_t bytes = Smem<T, D>::kForward;
    error = AllowSharedMemory(TcForwardKernel<T, D, A>, bytes, kOp);
    if (!error.ok()) return;
    const dim3 grid(static_cast<unsigned>(s.batch * s.num_heads), static_cast<unsigned>(Tiles(s)));
    TcForwardKernel<T, D, A>
        <<<grid, kThreads, bytes, stream>>>(static_cast<const A*>(q), static_cast<const A*>(k),
                                            static_cast<const A*>(v), s, static_cast<A*>(out), lse);
    error = LaunchResult(kOp);
  });
  return taken ? error : ArgumentError(kNotTaken, kOp);
}

OpError TensorCoreAttentionBackward(cudaStream_t stream, DType dtype, DType act,
                                    const AttentionShape& s, const void* q, const void* k,
                                    const void* v, const void* out, const float* lse,
                                    const void* dout, float* delta, void* dq, void* dk, void* dv) {
  constexpr const char* kOp = "AttentionBackward";
  OpError error{};
  const bool taken = DispatchTensorCores(dtype, act, s.head_dim, [&](auto tag, auto dim, auto a) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    using A = decltype(a);
    const A* q_a = static_cast<const A*>(q);
    const A* k_a = static_cast<const A*>(k);
    const A* v_a = static_cast<const A*>(v);
    const A* dout_a = static_cast<const A*>(dout);
    const size_t rows = s.batch * s.num_heads * s.seq;
    TcDeltaKernel<T, D, A>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
            static_cast<const A*>(out), dout_a, s, delta);
    error = LaunchResult(kOp);
    if (!error.ok()) return;
    constexpr size_t bytes = Smem<T, D>::kBackward;
    error = AllowSharedMemory(TcBackwardKeyKernel<T, D, A>, bytes, kOp);
    if (!error.ok()) return;
    error = AllowSharedMemory(TcBackwardQueryKernel<T, D, A>, bytes, kOp);
    if (!error.ok()) return;
    const unsigned tiles = static_cast<unsigned>(Tiles(s));
    TcBackwardKeyKernel<T, D, A>
        <<<dim3(static_cast<unsigned>(s.batch * s.num_kv_heads), tiles), kThreads, bytes, stream>>>(
            q_a, k_a, v_a, lse, delta, dout_a, s, static_cast<A*>(dk), static_cast<A*>(dv));
    error = LaunchResult(kOp);
    if (!error.ok()) return;
    TcBackwardQueryKernel<T, D, A>
        <<<dim3(static_cast<unsigned>(s.batch * s.num_heads), tiles), kThreads, bytes, stream>>>(
            q_a, k_a, v_a, lse, delta, dout_a, s, static_cast<A*>(dq));
    error = LaunchResult(kOp);
  });
  return taken ? error : ArgumentError(kNotTaken, kOp);
}

}  // namespace strata::model::cuda::detail
