// The CUDA device: the device contract (device_contract_test.cc) instantiated as Gpu/..., plus
// what only the CUDA device does: kernels that match the CPU device bit for bit, the caching
// allocator, callbacks that may call CUDA. Every test skips when no CUDA device can be created
// (no GPU, no driver, or a build without CUDA).
#include <gtest/gtest.h>

#include <cmath>
#include <future>
#include <limits>
#include <random>
#include <vector>

#include "device/device_test_util.h"

namespace strata::device::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Gpu, DeviceContractTest, ::testing::Values(DeviceType::kCuda),
                         DeviceTypeParamName);

// The CUDA device, or nullptr with the reason in `why`.
std::unique_ptr<Device> MakeCudaDevice(uint64_t budget, std::string* why) {
  DeviceOptions options;
  options.type = DeviceType::kCuda;
  options.memory_budget = budget;
  Result<std::unique_ptr<Device>> device = CreateDevice(options);
  if (!device.ok()) {
    *why = "no CUDA device: " + device.status().ToString();
    return nullptr;
  }
  return std::move(device).value();
}

// Runs the same element-wise program on `device` and returns the bytes of its three buffers.
// Program: x <- input (as dtype), y <- input reversed; y = cast(x); x *= alpha; y += beta * x;
// z = fill(value); w = cast(x -> other dtypes and back).
struct ProgramResult {
  std::vector<uint8_t> x, y, z, w;
};
::testing::AssertionResult RunProgram(Device& device, DType dtype, const std::vector<float>& input,
                                      ProgramResult* out) {
  const size_t n = input.size();
  const size_t bytes = n * DTypeSize(dtype);
  std::vector<float> reversed(input.rbegin(), input.rend());
  const std::vector<uint8_t> hx = EncodeAs(input, dtype);
  const std::vector<uint8_t> hy = EncodeAs(reversed, dtype);
  auto stream = device.CreateStream("program");
  if (!stream.ok()) return ::testing::AssertionFailure() << stream.status().ToString();
  Stream& s = **stream;
  std::vector<void*> buffers;
  for (size_t size : {bytes, bytes, bytes, bytes, n * 4}) {
    Result<void*> p = device.Alloc(size);
    if (!p.ok()) return ::testing::AssertionFailure() << p.status().ToString();
    buffers.push_back(*p);
  }
  void *x = buffers[0], *y = buffers[1], *z = buffers[2], *w = buffers[3], *f32 = buffers[4];
  const DType other = dtype == DType::kF16 ? DType::kBF16 : DType::kF16;
  Status st = device.CopyAsync(x, hx.data(), bytes, CopyKind::kHostToDevice, s);
  if (st.ok()) st = device.CopyAsync(y, hy.data(), bytes, CopyKind::kHostToDevice, s);
  if (st.ok()) st = device.Scale(x, dtype, 0.7f, n, s);
  if (st.ok()) st = device.Axpy(-1.3f, x, y, dtype, n, s);
  if (st.ok()) st = device.Fill(z, dtype, 1.0f / 3.0f, n, s);
  if (st.ok()) st = device.Cast(x, dtype, f32, DType::kF32, n, s);
  if (st.ok()) st = device.Cast(f32, DType::kF32, w, other, n, s);
  out->x.resize(bytes);
  out->y.resize(bytes);
  out->z.resize(bytes);
  out->w.resize(n * DTypeSize(other));
  if (st.ok()) st = device.CopyAsync(out->x.data(), x, bytes, CopyKind::kDeviceToHost, s);
  if (st.ok()) st = device.CopyAsync(out->y.data(), y, bytes, CopyKind::kDeviceToHost, s);
  if (st.ok()) st = device.CopyAsync(out->z.data(), z, bytes, CopyKind::kDeviceToHost, s);
  if (st.ok()) st = device.CopyAsync(out->w.data(), w, out->w.size(), CopyKind::kDeviceToHost, s);
  if (st.ok()) st = device.Synchronize(s);
  for (void* p : buffers)
    device.Free(p);
  if (!st.ok()) return ::testing::AssertionFailure() << st.ToString();
  return ::testing::AssertionSuccess();
}

TEST(CudaDeviceGpuTest, KernelsMatchTheCpuDeviceBitForBit) {
  std::string why;
  auto gpu = MakeCudaDevice(uint64_t{256} << 20, &why);
  if (gpu == nullptr) GTEST_SKIP() << why;
  DeviceOptions cpu_options;
  cpu_options.memory_budget = uint64_t{256} << 20;
  ASSERT_OK_AND_ASSIGN(auto cpu, CreateDevice(cpu_options));

  std::vector<float> input = InterestingFloats();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  while (input.size() < (size_t{1} << 20) + 77) {
    input.push_back(std::ldexp(normal(rng), static_cast<int>(rng() % 60) - 30));
  }
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    ProgramResult on_cpu, on_gpu;
    ASSERT_TRUE(RunProgram(*cpu, dtype, input, &on_cpu));
    ASSERT_TRUE(RunProgram(*gpu, dtype, input, &on_gpu));
    EXPECT_TRUE(on_cpu.x == on_gpu.x) << "scale";
    EXPECT_TRUE(on_cpu.y == on_gpu.y) << "axpy";
    EXPECT_TRUE(on_cpu.z == on_gpu.z) << "fill";
    EXPECT_TRUE(on_cpu.w == on_gpu.w) << "cast";
  }
}

TEST(CudaDeviceGpuTest, Int8QuantizationMatchesTheCpuDeviceBitForBit) {
  std::string why;
  auto gpu = MakeCudaDevice(uint64_t{256} << 20, &why);
  if (gpu == nullptr) GTEST_SKIP() << why;
  ASSERT_OK_AND_ASSIGN(auto cpu, CreateDevice({}));
  std::vector<float> x(size_t{2048} * 301);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = std::ldexp(normal(rng), static_cast<int>(rng() % 20) - 10);
  std::fill(x.begin(), x.begin() + 2048, 0.0f);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    ASSERT_OK_AND_ASSIGN(Int8RoundTrip on_cpu, RoundTripInt8(*cpu, dtype, x, 2048));
    ASSERT_OK_AND_ASSIGN(Int8RoundTrip on_gpu, RoundTripInt8(*gpu, dtype, x, 2048));
    EXPECT_TRUE(on_cpu.scales == on_gpu.scales) << "scales";
    EXPECT_TRUE(on_cpu.q == on_gpu.q) << "int8 values";
    EXPECT_TRUE(on_cpu.y == on_gpu.y) << "dequantized values";
  }
}

// The gradient-norm reduction: the CPU device's running sum is the oracle (within 1e-12
// relative: the GPU adds per-block partial sums, a different order); the GPU gives the same bits
// on every run and the same total in one call or many; Inf propagates.
TEST(CudaDeviceGpuTest, SumSquaresMatchesTheCpuDeviceAndIsDeterministic) {
  std::string why;
  auto gpu = MakeCudaDevice(uint64_t{256} << 20, &why);
  if (gpu == nullptr) GTEST_SKIP() << why;
  auto cpu = CreateDevice({});
  ASSERT_TRUE(cpu.ok());
  std::vector<float> x((size_t{1} << 22) + 333);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  for (float& v : x) v = normal(rng);
  ASSERT_OK_AND_ASSIGN(double want, SumSquaresInPieces(**cpu, x, x.size(), 0.25));
  ASSERT_OK_AND_ASSIGN(double once, SumSquaresInPieces(*gpu, x, x.size(), 0.25));
  ASSERT_OK_AND_ASSIGN(double again, SumSquaresInPieces(*gpu, x, x.size(), 0.25));
  ASSERT_OK_AND_ASSIGN(double pieces, SumSquaresInPieces(*gpu, x, 100003, 0.25));
  EXPECT_NEAR(once, want, 1e-12 * want);
  EXPECT_EQ(once, again) << "the same bits on every run";
  EXPECT_NEAR(pieces, want, 1e-12 * want);
  x[x.size() / 2] = std::numeric_limits<float>::infinity();
  ASSERT_OK_AND_ASSIGN(double inf, SumSquaresInPieces(*gpu, x, x.size(), 0.0));
  EXPECT_TRUE(std::isinf(inf));
}

TEST(CudaDeviceGpuTest, FreedBlocksAreReusedAndTheCacheYieldsToTheBudget) {
  std::string why;
  auto device = MakeCudaDevice(uint64_t{8} << 20, &why);
  if (device == nullptr) GTEST_SKIP() << why;
  ASSERT_OK_AND_ASSIGN(void* p, device->Alloc(1000));
  device->Free(p);
  ASSERT_OK_AND_ASSIGN(void* q, device->Alloc(900));  // the same 1 KiB bucket
  EXPECT_EQ(q, p);
  EXPECT_EQ(device->memory_stats().in_use, 1024u);
  device->Free(q);

  // 6 MiB cached, then 7 MiB (an 8 MiB block): fits the budget only once the cache is dropped.
  ASSERT_OK_AND_ASSIGN(void* six, device->Alloc(uint64_t{6} << 20));
  device->Free(six);
  ASSERT_OK_AND_ASSIGN(void* seven, device->Alloc(uint64_t{7} << 20));
  EXPECT_EQ(device->memory_stats().in_use, uint64_t{7} << 20);
  EXPECT_EQ(device->Alloc(uint64_t{2} << 20).status().code(), StatusCode::kResourceExhausted);
  device->Free(seven);
}

TEST(CudaDeviceGpuTest, TheCacheGivesBackOnlyWhatANewBlockNeeds) {
  std::string why;
  auto device = MakeCudaDevice(uint64_t{8} << 20, &why);
  if (device == nullptr) GTEST_SKIP() << why;
  const uint64_t two = uint64_t{2} << 20;
  ASSERT_OK_AND_ASSIGN(void* a, device->Alloc(two));
  ASSERT_OK_AND_ASSIGN(void* b, device->Alloc(two));
  ASSERT_OK_AND_ASSIGN(void* small, device->Alloc(1000));
  device->Free(a);
  device->Free(b);
  device->Free(small);
  // Cached: two 2 MiB blocks and one 1 KiB block (4 MiB + 1 KiB). A 4 MiB block needs 1 KiB more
  // than the budget leaves, so exactly one 2 MiB block (the largest) is given back.
  ASSERT_OK_AND_ASSIGN(void* four, device->Alloc(uint64_t{4} << 20));
  EXPECT_EQ(device->memory_stats().cached, two + 1024) << "one 2 MiB block and the 1 KiB block";
  ASSERT_OK_AND_ASSIGN(void* again, device->Alloc(two));
  EXPECT_TRUE(again == a || again == b) << "the other 2 MiB block stayed cached";
  ASSERT_OK_AND_ASSIGN(void* small_again, device->Alloc(900));
  EXPECT_EQ(small_again, small) << "the 1 KiB block stayed cached";
  EXPECT_EQ(device->memory_stats().in_use, (uint64_t{6} << 20) + 1024);
  EXPECT_EQ(device->memory_stats().cached, 0u);
  device->Free(four);
  device->Free(again);
  device->Free(small_again);
}

// A wrong pointer is refused before it reaches the GPU, where it would end the CUDA context.
TEST(CudaDeviceGpuTest, OperandsMustLieInsideOneAllocation) {
  std::vector<char> host(2000);  // declared before the stream, which drains when destroyed
  std::string why;
  auto device = MakeCudaDevice(uint64_t{64} << 20, &why);
  if (device == nullptr) GTEST_SKIP() << why;
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK_AND_ASSIGN(void* d, device->Alloc(1000));
  Status past = device->CopyAsync(d, host.data(), 1001, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("h2d copy: destination"), std::string::npos) << past.ToString();
  EXPECT_NE(past.message().find("not inside one allocation"), std::string::npos)
      << past.ToString();
  EXPECT_OK(device->CopyAsync(static_cast<char*>(d) + 500, host.data(), 500,
                              CopyKind::kHostToDevice, *stream));
  EXPECT_EQ(device->CopyAsync(host.data(), d, 8, CopyKind::kDeviceToDevice, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->Fill(d, DType::kF32, 0.0f, 251, *stream).code(),
            StatusCode::kInvalidArgument);  // 1004 bytes
  EXPECT_EQ(device->Cast(d, DType::kF32, host.data(), DType::kBF16, 4, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->Axpy(1.0f, host.data(), d, DType::kF32, 4, *stream).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(device->Synchronize(*stream));
  device->Free(d);
  EXPECT_EQ(device->Scale(d, DType::kF32, 2.0f, 1, *stream).code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceGpuTest, NotifyCallbackMayCallTheDevice) {
  std::vector<float> host(16, 0.0f);  // declared before the streams, which drain when destroyed
  std::promise<Status> enqueued;
  std::string why;
  auto device = MakeCudaDevice(uint64_t{64} << 20, &why);
  if (device == nullptr) GTEST_SKIP() << why;
  ASSERT_OK_AND_ASSIGN(auto stream, device->CreateStream("s"));
  ASSERT_OK_AND_ASSIGN(auto other, device->CreateStream("other"));
  ASSERT_OK_AND_ASSIGN(void* d, device->Alloc(64));
  ASSERT_OK(device->Fill(d, DType::kF32, 5.0f, 16, *stream));
  ASSERT_OK(device->Notify(*stream, [&](const Status&) {
    // Runs on the stream's callback thread, which has selected the GPU.
    Status s = device->CopyAsync(host.data(), d, 64, CopyKind::kDeviceToHost, *other);
    enqueued.set_value(s);
  }));
  auto future = enqueued.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  ASSERT_OK(future.get());
  ASSERT_OK(device->Synchronize(*other));
  EXPECT_EQ(host, std::vector<float>(16, 5.0f));
  device->Free(d);
}

TEST(CudaDeviceGpuTest, MissingOrdinalIsInvalidArgument) {
  std::string why;
  auto probe = MakeCudaDevice(uint64_t{1} << 20, &why);
  if (probe == nullptr) GTEST_SKIP() << why;
  DeviceOptions options;
  options.type = DeviceType::kCuda;
  options.ordinal = 4096;
  Result<std::unique_ptr<Device>> device = CreateDevice(options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument) << device.status().ToString();
}

}  // namespace
}  // namespace strata::device::testing
