// Helpers shared by the Collective tests: per-rank inputs whose fp32 sums are exact (so the
// expected result of a reduction does not depend on the order in which a backend adds), the
// reference results, element access by dtype, and an environment-variable guard.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <ostream>
#include <string>

#include "device/device_test_util.h"
#include "device/dtype_convert.h"
#include "strata/collective.h"
#include "strata/device.h"

// Test names and failure messages show "bf16" / "avg" instead of a byte dump.
namespace strata::device {
inline void PrintTo(DType dtype, std::ostream* os) {
  *os << DTypeName(dtype);
}
}  // namespace strata::device
namespace strata::comm {
inline void PrintTo(ReduceOp op, std::ostream* os) {
  *os << ReduceOpName(op);
}
}  // namespace strata::comm

namespace strata::comm::testing {

using device::DType;

// Rank `rank`'s input at index `i`: k / 64 for an integer k in [-255, 255] (8 significant bits),
// exactly representable in fp32, bf16 and fp16. A sum over up to 2^15 ranks is exact in fp32;
// it often has more significant bits than bf16 keeps, so the one rounding is exercised: with 4
// ranks, rounding each partial sum to bf16 instead would change about a third of the results.
inline float InputValue(int rank, size_t i) {
  const auto k = static_cast<int>((i * 131 + static_cast<size_t>(rank) * 71 + 17) % 511) - 255;
  return static_cast<float>(k) / 64.0f;
}

// Stores `value` (rounded to nearest even) as element i of a `dtype` buffer.
inline void StoreValue(void* buffer, DType dtype, size_t i, float value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(buffer)[i] = value;
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(buffer)[i] = device::convert::FloatToBf16(value);
      return;
    case DType::kF16:
      static_cast<uint16_t*>(buffer)[i] = device::convert::FloatToF16(value);
      return;
  }
}

// The bit pattern of element i of a `dtype` buffer.
inline uint32_t LoadBits(const void* buffer, DType dtype, size_t i) {
  if (dtype == DType::kF32) {
    uint32_t bits;
    std::memcpy(&bits, static_cast<const float*>(buffer) + i, sizeof(bits));
    return bits;
  }
  return static_cast<const uint16_t*>(buffer)[i];
}

// The bits a reduction must produce from an exact fp32 sum: sum (times 1/world for avg) rounded
// once to `dtype`.
// The largest InputValue over `world` ranks at element i: what kMax gives (the values are exact
// in every dtype, so rounding does not enter).
inline float MaxInput(size_t i, int world) {
  float m = InputValue(0, i);
  for (int q = 1; q < world; ++q) m = std::max(m, InputValue(q, i));
  return m;
}

inline uint32_t ExpectedBits(DType dtype, float exact_sum, ReduceOp op, int world) {
  const float value =
      op == ReduceOp::kAvg ? exact_sum * (1.0f / static_cast<float>(world)) : exact_sum;
  switch (dtype) {
    case DType::kF32:
      return device::testing::Bits(value);
    case DType::kBF16:
      return device::convert::FloatToBf16(value);
    case DType::kF16:
      return device::convert::FloatToF16(value);
  }
  return 0;
}

// The exact fp32 sum over ranks 0..world-1 of InputValue(rank, i).
inline float ExactSum(size_t i, int world) {
  float sum = 0.0f;
  for (int r = 0; r < world; ++r)
    sum += InputValue(r, i);
  return sum;
}

// The enqueue-order tests (many all-reduces alternating between two streams): operation k
// reduces OrderingInput(k, rank) on every element, averaging every third operation.
inline ReduceOp OrderingOp(int k) {
  return k % 3 == 0 ? ReduceOp::kAvg : ReduceOp::kSum;
}
inline float OrderingInput(int k, int rank) {
  return static_cast<float>(k * 16 + rank);
}
inline float OrderingResult(int k, int world) {
  float sum = 0.0f;
  for (int r = 0; r < world; ++r)
    sum += OrderingInput(k, r);
  return OrderingOp(k) == ReduceOp::kAvg ? sum * (1.0f / static_cast<float>(world)) : sum;
}

// Sets (or, with nullopt, unsets) environment variables for a scope, then restores them.
class EnvGuard {
 public:
  EnvGuard() = default;
  ~EnvGuard() {
    for (const auto& [name, old] : saved_) {
      if (old) {
        ::setenv(name.c_str(), old->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

  void Set(const std::string& name, std::optional<std::string> value) {
    if (saved_.find(name) == saved_.end()) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old != nullptr ? std::optional<std::string>(old) : std::nullopt;
    }
    if (value) {
      ::setenv(name.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name.c_str());
    }
  }
  // Unsets every variable a launcher sets (so a test sees "none").
  void ClearLauncher() {
    for (const char* name :
         {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK",
          "PMI_SIZE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
          "SLURM_LOCALID"}) {
      Set(name, std::nullopt);
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

}  // namespace strata::comm::testing
