// Helpers for the Device tests: status assertions, a gate that holds a stream busy, and the
// fixture of the device contract tests (device_contract_test.cc), which cpu_device_test.cc and
// cuda_device_test.cc instantiate for their backend.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/status.h"
#include "strata/trace.h"

#define STRATA_DEVICE_TEST_CHECK_OK_(fail, expr)                                       \
  do {                                                                                 \
    const auto& strata_test_value_ = (expr);                                           \
    const ::strata::Status& strata_test_status_ =                                      \
        ::strata::internal::AsStatus(strata_test_value_);                              \
    fail(strata_test_status_.ok()) << #expr << ": " << strata_test_status_.ToString(); \
  } while (false)
#define EXPECT_OK(expr) STRATA_DEVICE_TEST_CHECK_OK_(EXPECT_TRUE, expr)
#define ASSERT_OK(expr) STRATA_DEVICE_TEST_CHECK_OK_(ASSERT_TRUE, expr)
// `ASSERT_OK_AND_ASSIGN(auto x, MakeX());`
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(STRATA_STATUS_CONCAT_(strata_test_result_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr)                   \
  auto tmp = (expr);                                                 \
  ASSERT_TRUE(tmp.ok()) << #expr << ": " << tmp.status().ToString(); \
  lhs = std::move(tmp).value()

namespace strata::device {
// Test names and failure messages show "cpu" / "cuda" instead of a byte dump.
inline void PrintTo(DeviceType type, std::ostream* os) {
  *os << DeviceTypeName(type);
}
}  // namespace strata::device

namespace strata::device::testing {

// A one-shot latch: HostTask functions block in Wait until the test calls Open.
class Gate {
 public:
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // True once open; false after `timeout` (so a broken test fails instead of hanging).
  bool Wait(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// The bit pattern of a float (NaN-safe equality).
inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// fp32 inputs that exercise the conversions: signed zeros, Inf, quiet and signalling NaN, fp16
// subnormals and the fp16 underflow threshold, exact bf16/fp16 rounding ties (both parities),
// the fp16 overflow threshold, fp32 subnormals and extremes, and ordinary values.
std::vector<float> InterestingFloats();

// Reference results computed with the scalar conversions, as the device must produce them.
// `dtype` values are stored as DTypeSize(dtype) bytes each.
std::vector<uint8_t> EncodeAs(const std::vector<float>& values, DType dtype);
std::vector<float> DecodeFrom(const std::vector<uint8_t>& bytes, DType dtype);

// Polls `recorder` until it holds at least `count` events or 5 s passed (CUDA traces are written
// by a callback thread after the stream completed).
std::vector<TraceEvent> WaitForTraceEvents(const TraceRecorder& recorder, size_t count);

// "cpu" / "cuda": the test-name suffix of a DeviceContractTest instantiation.
inline std::string DeviceTypeParamName(const ::testing::TestParamInfo<DeviceType>& param_info) {
  return std::string(DeviceTypeName(param_info.param));
}

// Fixture of the device contract: one device (budget kBudget) with two streams and an event,
// created in SetUp. GetParam() is the backend; SetUp skips the test when a CUDA device cannot be
// created (no GPU, no driver, or a build without CUDA). Memory from DeviceAlloc is freed in
// TearDown after the streams are destroyed (which drains them).
class DeviceContractTest : public ::testing::TestWithParam<DeviceType> {
 protected:
  static constexpr uint64_t kBudget = uint64_t{64} << 20;

  void SetUp() override;
  void TearDown() override;

  // (Re)creates the device, streams and event. Fails (or skips, for CUDA) the test on error.
  void Open(uint64_t budget, TraceRecorder* trace = nullptr);
  void Close();

  // Device memory freed at TearDown; nullptr (and a test failure) when Alloc fails.
  void* DeviceAlloc(size_t bytes);
  // Copies on stream a() and synchronizes it.
  ::testing::AssertionResult Upload(void* device_dst, const void* host_src, size_t bytes);
  ::testing::AssertionResult Download(void* host_dst, const void* device_src, size_t bytes);

  // Synchronizes streams a and b when it goes out of scope. Declare one after the locals that
  // queued work uses, so that an early return (a failed ASSERT) cannot leave work running on
  // them after they are gone.
  class Drain {
   public:
    explicit Drain(DeviceContractTest* test) : test_(test) {}
    ~Drain() { test_->DrainStreams(); }
    Drain(const Drain&) = delete;
    Drain& operator=(const Drain&) = delete;

   private:
    DeviceContractTest* test_;
  };
  void DrainStreams();

  Device& device() { return *device_; }
  Stream& a() { return *a_; }
  Stream& b() { return *b_; }
  Event& event() { return *event_; }

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> a_, b_;
  std::unique_ptr<Event> event_;
  std::vector<void*> allocations_;
};

// Runs SumSquares over `x` (fp32, copied to the device) in pieces of `piece` elements, starting
// from `start`; returns *sum.
inline Result<double> SumSquaresInPieces(Device& device, const std::vector<float>& x, size_t piece,
                                  double start) {
  STRATA_ASSIGN_OR_RETURN(auto s, device.CreateStream("s"));
  STRATA_ASSIGN_OR_RETURN(void* buf, device.Alloc(x.size() * 4));
  STRATA_ASSIGN_OR_RETURN(void* sum_buf, device.Alloc(sizeof(double)));
  double* sum = static_cast<double*>(sum_buf);
  float* data = static_cast<float*>(buf);
  double out = 0;
  Status st = device.CopyAsync(data, x.data(), x.size() * 4, CopyKind::kHostToDevice, *s);
  if (st.ok()) st = device.CopyAsync(sum, &start, 8, CopyKind::kHostToDevice, *s);
  for (size_t i = 0; st.ok() && i < x.size(); i += piece) {
    st = device.SumSquares(data + i, DType::kF32, std::min(piece, x.size() - i), sum, *s);
  }
  if (st.ok()) st = device.CopyAsync(&out, sum, 8, CopyKind::kDeviceToHost, *s);
  if (st.ok()) st = device.Synchronize(*s);
  device.Free(buf);
  device.Free(sum_buf);
  STRATA_RETURN_IF_ERROR(st);
  return out;
}

// QuantizeInt8 then DequantizeInt8 of `input` (encoded as `dtype`) on `device`, in blocks of
// `block`: the int8 values, the scales and the dequantized values' bytes.
struct Int8RoundTrip {
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<uint8_t> y;
};
inline Result<Int8RoundTrip> RoundTripInt8(Device& device, DType dtype,
                                           const std::vector<float>& input, size_t block) {
  const size_t n = input.size();
  const std::vector<uint8_t> x = EncodeAs(input, dtype);
  STRATA_ASSIGN_OR_RETURN(auto stream, device.CreateStream("int8"));
  Int8RoundTrip out;
  out.q.resize(n);
  out.scales.resize(n / block);
  out.y.resize(x.size());
  std::vector<void*> buffers;
  Status st;
  for (size_t size : {x.size(), n, n / block * sizeof(float) + 4, x.size()}) {
    Result<void*> p = device.Alloc(size);
    if (!p.ok()) {
      st = p.status();
      break;
    }
    buffers.push_back(*p);
  }
  if (st.ok()) {
    void *dx = buffers[0], *dq = buffers[1], *dy = buffers[3];
    auto* ds = static_cast<float*>(buffers[2]);
    st = device.CopyAsync(dx, x.data(), x.size(), CopyKind::kHostToDevice, *stream);
    if (st.ok()) st = device.QuantizeInt8(dx, dtype, n, block, dq, ds, *stream);
    if (st.ok()) st = device.DequantizeInt8(dq, ds, n, block, dy, dtype, *stream);
    if (st.ok()) st = device.CopyAsync(out.q.data(), dq, n, CopyKind::kDeviceToHost, *stream);
    if (st.ok()) {
      st = device.CopyAsync(out.scales.data(), ds, n / block * sizeof(float),
                            CopyKind::kDeviceToHost, *stream);
    }
    if (st.ok()) st = device.CopyAsync(out.y.data(), dy, x.size(), CopyKind::kDeviceToHost, *stream);
    Status synced = device.Synchronize(*stream);
    if (st.ok()) st = synced;
  }
  for (void* p : buffers)
    device.Free(p);
  STRATA_RETURN_IF_ERROR(st);
  return out;
}

}  // namespace strata::device::testing
