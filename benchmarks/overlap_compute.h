// The work strata_overlap_bench (overlap.cc) runs for each unit access, behind one interface for
// both devices: the check that the unit holds what was written, and the GEMM that reads it.
//
//   cpu   (overlap.cc) one host task per access on the compute stream: it compares three floats
//         of the unit with what was written, then runs C = A W on OpenBLAS (one thread), timed
//         on the host clock around cblas_sgemm.
//   cuda  (overlap_cuda.cc) a host task cannot read device memory: the three floats are copied
//         D2H into a slot of a small registered host buffer, a host task compares the slot, and
//         the GEMM is y = x W^T on cuBLAS (model::cuda::LinearForward, fp32 without TF32),
//         timed with CUDA events recorded around it on the compute stream.
//
// The unit is K x N fp32 (K = kGemmK) and serves as the GEMM's weight: on cpu W [K, N] row-major
// with C [M, N] = A [M, K] W; on cuda W [K, N] read as LinearForward's [out = K, in = N] with
// y [M, K] = x [M, N] W^T. Both are 2 M N K flops over the unit's bytes; when the calibration
// narrows the columns to n < N, the cpu GEMM reads the leading n columns (row stride N) and the
// cuda GEMM the leading K x n floats.
//
// Threading: one thread (the consumer) calls a UnitCompute; the work it enqueues runs in stream
// order on the stream it was created for.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::bench {

// The rows of a unit's weight matrix (K x N fp32, K * N * 4 = unit bytes).
inline constexpr int kGemmK = 1024;

// The GEMM run for each access, as the calibration chose it.
struct GemmShape {
  int m = 1;     // activation rows
  int n = 1;     // unit columns it uses: the unit's full width but at the smallest targets
  int reps = 1;  // GEMMs per access (above 1 only on cuda, where even the most rows run too fast)
};

// Bytes of the cuda GEMM's activations x [M, n] and output y [M, K] (fp32).
inline uint64_t GemmInputBytes(const GemmShape& s) {
  return static_cast<uint64_t>(s.m) * static_cast<uint64_t>(s.n) * sizeof(float);
}
inline uint64_t GemmOutputBytes(const GemmShape& s) {
  return static_cast<uint64_t>(s.m) * kGemmK * sizeof(float);
}

// Three floats of a unit and the values written there: what every access checks.
struct UnitCheck {
  int unit = 0;
  std::array<size_t, 3> positions{};  // float indices into the unit
  std::array<float, 3> expect{};
};

// A fast deterministic generator of floats in [-1, 1).
class FloatStream {
 public:
  explicit FloatStream(uint64_t seed) : x_(seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull) {}
  float Next() {
    x_ ^= x_ << 13;
    x_ ^= x_ >> 7;
    x_ ^= x_ << 17;
    return static_cast<float>(static_cast<int32_t>(x_ >> 32)) * (1.0f / 2147483648.0f);
  }
  void Fill(float* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
      p[i] = Next();
  }

 private:
  uint64_t x_;
};

// The compute of unit accesses on one device's compute stream.
class UnitCompute {
 public:
  // Implementations wait for the stream's work first: it may use their buffers.
  virtual ~UnitCompute() = default;

  // Enqueues one access's work on the stream, reading the unit at `w` (device memory that must
  // stay valid until this work has run): with `check`, a host task that fails with DataLoss
  // (the device's sticky error) unless the unit's floats at check->positions equal
  // check->expect; with `gemm`, the GEMM (`reps` times; the object must have been created with
  // a shape). `label` names the work in traces. Does not wait for the work to run.
  virtual Status Enqueue(const float* w, const UnitCheck* check, bool gemm,
                         std::string_view label) = 0;

  // Seconds spent inside the GEMMs enqueued so far, summed. Call only after the stream was
  // synchronized (Device::Synchronize(stream) since the last Enqueue).
  virtual Result<double> GemmSeconds() = 0;

 protected:
  UnitCompute() = default;
  UnitCompute(const UnitCompute&) = delete;
  UnitCompute& operator=(const UnitCompute&) = delete;
};

#if defined(STRATA_WITH_CUDA)
// The cuda implementation (overlap_cuda.cc) on `stream` of `device` (a CUDA device), both of
// which must outlive it. `shape` empty: the check alone (Enqueue with gemm = false only).
// `in_flight`: how many accesses' work the caller lets queue behind the one running (its
// --run-ahead); the object keeps one more set of sample slot and events than that, so that a
// slot is only reused once its previous access has run (Enqueue waits for that, which with the
// caller's discipline never blocks). Allocates x and y (GemmInputBytes + GemmOutputBytes) from
// `device`, and an OpsContext (cuBLAS handle) on `stream`.
Result<std::unique_ptr<UnitCompute>> CreateCudaUnitCompute(device::Device& device,
                                                           device::Stream& stream,
                                                           std::optional<GemmShape> shape,
                                                           int in_flight);
#endif

}  // namespace strata::bench
