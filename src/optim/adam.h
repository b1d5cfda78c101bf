// Adam / AdamW over one shard of fp32 master weights, on the CPU (SIMD, run-time ISA dispatch)
// and on the GPU (one fused kernel: adam_cuda_kernel.h, launched by DeviceAdamStep in
// device_adam.h).
//
// One step, per element i (g = grad[i] * grad_scale, t = step, starting at 1):
//   decoupled (AdamW):  p -= lr * weight_decay * p            (before the moment update)
//   L2 (Adam):          g += weight_decay * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   bias_correction:    m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)   (else m, v)
//   p -= lr * m_hat / (sqrt(v_hat) + eps)
//   out16[i] = p rounded to nearest even in out_dtype   (when out16 is set)
// This is torch.optim.AdamW's / Adam's arithmetic (the decay is applied to p first, then the
// update uses the decayed p), in fp32, with the per-step scalars (bias corrections, lr * wd)
// computed once in double and rounded to fp32.
//
// grad_scale folds loss-scale removal, gradient averaging and the clipping coefficient into one
// multiply; the caller computes it.
//
// The fp32 evaluation, exactly (adam_element.h holds it as code). Per step, in double, rounded
// once to fp32: gs = grad_scale, b1 = beta1, c1 = 1 - beta1, b2 = beta2, c2 = 1 - beta2, eps,
// wd = weight_decay (L2), lwd = lr * weight_decay (AdamW), ss = lr / (1 - beta1^t) and
// sb2 = sqrt(1 - beta2^t) (ss = lr and sb2 = 1 without bias correction). Per element:
//   g = grad * gs
//   if wd != 0:  L2: g = wd * p + g        AdamW: p = p - lwd * p
//   m = b1 * m + c1 * g
//   v = b2 * v + (c2 * g) * g
//   d = sqrt(v) / sb2 + eps
//   p = p - ss * (m / d)
// (the form of torch's own kernel: lr / bias_correction1 and sqrt(bias_correction2) are folded
// into step scalars). With weight_decay == 0 the decay line is skipped, as torch does, so an Inf
// in p stays Inf instead of becoming NaN through 0 * Inf.
//
// What may differ between paths, and by how much:
//   - The scalar path (Isa::kScalar) evaluates each a * b + c as two rounded operations; it is
//     the reference for the GPU kernel, which uses the same operations with explicit rounding
//     (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn) and so gives the same bits.
//   - The AVX2 and AVX-512 paths fuse each a * b + c (and p - lwd * p, p - ss * (m / d)) into one
//     FMA, and compute d as one FMA with isb2 = 1 / sqrt(1 - beta2^t) (in double, rounded once):
//     d = sqrt(v) * isb2 + eps. That leaves two operations for the divider per element (the
//     square root and m / d) instead of three, which is what bounds the loop on cores whose
//     512-bit division is slow. They give the same bits as each other, for every n and thread
//     count; they differ from the scalar path only by those roundings.
//   - Every path is within a few fp32 ulps of ReferenceAdamStepDouble, measured against the
//     magnitudes of the terms that are summed (tests/optim/adam_test.cc states the bound): a
//     result that cancels (m near 0 after a sign change of g) is only as exact as its terms.
//   - v = b2 * v + c2 * g * g is fp32: |g| above about 1.8e19 overflows it to Inf (then the
//     update of that element is 0), as it does in torch's fp32 Adam.
//   - The 16-bit copy is bit-identical to strata::device::FloatToBf16 / FloatToF16 of the
//     stored master value, NaN and subnormals included (as long as the MXCSR flush-to-zero and
//     denormals-are-zero bits are clear, the default).
//
// Threads: CpuAdamStep splits the shard into `threads` contiguous chunks whose boundaries are
// multiples of kAdamChunkAlignElements from the shard start (4 KiB of fp32: aligned pages when
// the arrays are 4 KiB-aligned), and no smaller than kAdamMinChunkElements, so a small shard
// uses fewer threads. The calling thread runs the first chunk; helper threads come from a
// persistent pool owned by this module (created on first use, grown to the largest `threads`
// asked for, joined at exit). Element results do not depend on the split.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::optim {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  // AdamW (true) or Adam with L2 (false)
  bool bias_correction = true;
  int64_t step = 1;         // the step being taken, >= 1
  double grad_scale = 1.0;  // grad is multiplied by this first
};

// One shard. master, grad, m, v hold n fp32 elements; out16 (optional) receives n elements of
// out_dtype (kBF16 or kF16; kF32 copies p). No two arrays may overlap.
struct AdamShard {
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  size_t n = 0;
  void* out16 = nullptr;
  device::DType out_dtype = device::DType::kBF16;
};

// Chunk boundaries of a multi-threaded step, in elements from the shard start.
inline constexpr size_t kAdamChunkAlignElements = 1024;  // 4 KiB of fp32
inline constexpr size_t kAdamMinChunkElements = 64 * 1024;

// kAvx2 also needs FMA and F16C; kAvx512 needs AVX-512 F, BW and VL.
enum class Isa : uint8_t { kScalar, kAvx2, kAvx512 };
std::string_view IsaName(Isa isa);  // "scalar", "avx2", "avx512"
// ISAs this CPU and this build can run, scalar first.
std::vector<Isa> SupportedIsas();
// The fastest supported ISA (STRATA_ADAM_ISA=scalar|avx2|avx512 in the environment overrides it;
// an unsupported value is ignored with a warning).
Isa BestIsa();

struct CpuAdamOptions {
  Isa isa = Isa::kScalar;  // use BestIsa() for speed; kScalar is the reference path
  int threads = 1;         // >= 1; the shard is split in contiguous 4 KiB-aligned chunks
};

// Runs one step over the shard on the calling thread plus up to (threads - 1) helper threads.
// Arrays need only their element's alignment; 64-byte-aligned ones are fastest. When the
// shard's arrays total 64 MiB or more, the 16-bit copy is written with non-temporal stores
// (it would not stay cached anyway, and that saves reading its lines first). May be called
// from several threads at once (on different shards): each call waits only for its own chunks.
// InvalidArgument for null or overlapping arrays with n > 0, an unsupported ISA, threads < 1,
// bad hyper-params
// (step < 1, beta outside [0, 1), eps <= 0, lr < 0, a weight_decay or grad_scale that is
// negative or not finite), an out_dtype that is not kBF16 / kF16 / kF32.
Status CpuAdamStep(const AdamHyper& hyper, const AdamShard& shard, const CpuAdamOptions& options);

// The reference: the same step in double precision per element (master, m, v are read as
// fp32, computed in double, stored rounded to fp32). For tests.
void ReferenceAdamStepDouble(const AdamHyper& hyper, const AdamShard& shard);

}  // namespace strata::optim
