// Tests of the CUDA kernels (src/model/cuda_ops.h) against the CPU kernels (cpu_ops.h, which
// cpu_ops_test.cc checks against PyTorch): random inputs, the same op on both, and an explicit
// tolerance per op. An error is measured against the largest magnitude of the CPU result:
//   |gpu - cpu| <= tol * max|cpu|   for every element.
// Tolerances, and why:
//   exact  embedding forward and backward, residual add, gradient accumulation: the same fp32
//          operations in the same order (the embedding backward sums repeats in position order).
//   1e-5   every other fp32 path: RMSNorm (fp32 block sums against the CPU's double sums), fp32
//          linear (cuBLAS and OpenBLAS sum in different orders), RoPE (CUDA's double
//          sin/cos/pow), attention (online softmax and per-lane fp32 sums instead of sgemm),
//          SiluMul (fp32 against the CPU's double), cross-entropy (fp32 sums and expf). The
//          measured errors are far below (printed by each test).
//   1e-2   linear with bf16 or fp16 weights: the GEMM inputs are rounded to the weight's dtype
//          (activations and output gradients lose bits beyond 8 / 11), accumulation is fp32.
//   1e-2 / 3e-2  attention on the tensor cores (16-bit precision), against the CPU on inputs
//          rounded alike (see the test).
// 16-bit activations (the tests named Bf16Activations* and SixteenBitActivations*): the CPU runs
// the op in fp32 on the inputs rounded to bf16 (what the GPU reads), so what remains is each
// output's one rounding to its dtype (half an ulp: at most 2^-8 = 3.9e-3 of the element in bf16,
// 2^-11 = 4.9e-4 in fp16) on top of the fp32 differences above:
//   exact  residual add, gradient accumulation, scale, bias forward and embedding forward (against
//          the CPU's fp32 result rounded to bf16), embedding backward and the shard
//          cross-entropy's row maximum (fp32 results of the same fp32 operations in the same
//          order).
//   5e-3   every bf16 output: 2^-8, plus room for fp32 sums in another order.
//   1e-3   fp16 outputs (2^-11 plus room), and fp32 outputs of 16-bit GEMMs on the same rounded
//          inputs (cuBLAS's fp32 accumulation on the tensor cores, in its own order).
//   1e-5   fp32 outputs of fp32 arithmetic on bf16 inputs: rstd, lse, the loss, RMSNorm's weight
//          gradient, an fp32 weight's linear layer (its GEMMs are fp32).
//   attention: the 16-bit precision's tolerances above plus 2^-8 for the stored output and
//          gradients (the tiled kernels: 1.4e-2 / 3.4e-2; bf16 on the exact kernels: 5e-3); cuDNN's
//          keep 1e-2 / 3e-2 (its outputs were bf16 before as well).
// Sizes include 1-element cases and sizes that are not multiples of the block (256), the warp
// (32) or the head-dim register tiles.
//
// Every GPU test is in the suite CudaOpsGpuTest (ctest label gpu) and skips when no CUDA device
// can be created (no GPU or driver). CudaOpsTest runs everywhere.
#include "model/cuda_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device/device_test_util.h"
#include "model/cpu_ops.h"
#include "model/cuda_ops_status.h"
#include "model/cudnn_loader.h"
#include "strata/device.h"
#include "test_support.h"

namespace strata::model {
namespace {

using device::DType;

constexpr double kF32Tolerance = 1e-5;
constexpr double k16BitGemmTolerance = 1e-2;
// 16-bit activations (see the top).
constexpr double kBf16Tolerance = 5e-3;
constexpr double kF16Tolerance = 1e-3;
constexpr double kF32From16BitGemmTolerance = 1e-3;

#define ASSERT_OP_OK(expr) ASSERT_OK(cuda::ToStatus(expr))

using strata::testing::RandomTokens;
using strata::testing::RandomVector;

// A weight in its storage dtype on the host; cpu() is the CPU ops' view of it.
struct HostWeight {
  DType dtype = DType::kF32;
  std::vector<uint8_t> bytes;
  cpu::Weight cpu() const { return cpu::Weight{bytes.data(), dtype}; }
};

HostWeight MakeWeight(const std::vector<float>& values, DType dtype) {
  HostWeight w{dtype, std::vector<uint8_t>(values.size() * device::DTypeSize(dtype))};
  device::ConvertHost(values.data(), DType::kF32, w.bytes.data(), dtype, values.size());
  return w;
}

double GemmTolerance(DType dtype) {
  return dtype == DType::kF32 ? kF32Tolerance : k16BitGemmTolerance;
}

// Expects |gpu - cpu| <= tol * max|cpu| elementwise; prints the measured worst error.
void ExpectClose(const std::string& what, const std::vector<float>& gpu,
                 const std::vector<float>& cpu, double tol) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double max_ref = 0.0;
  for (float c : cpu)
    max_ref = std::max(max_ref, std::abs(static_cast<double>(c)));
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = std::abs(static_cast<double>(gpu[i]) - cpu[i]);
    if (std::isnan(err) || err > worst) {
      worst = std::isnan(err) ? INFINITY : err;
      at = i;
    }
  }
  std::printf("  %-34s max err %.3g, max |cpu| %.3g, ratio %.3g [tol %.0e]\n", what.c_str(), worst,
              max_ref, max_ref > 0 ? worst / max_ref : worst, tol);
  EXPECT_LE(worst, tol * max_ref) << what << ": element " << at << " is " << gpu[at] << ", CPU "
                                  << cpu[at];
}

void ExpectBitEqual(const std::string& what, const std::vector<float>& gpu,
                    const std::vector<float>& cpu) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << gpu[i] << ", CPU " << cpu[i];
      return;
    }
  }
}

std::string Label(const std::string& what, DType dtype) {
  return what + " " + std::string(device::DTypeName(dtype));
}

// fp32 device memory as an activation of the CUDA ops (cuda_ops.h: Act, CAct).
cuda::Act F32(float* p) {
  return cuda::Act{p, cuda::DType::kF32};
}
cuda::CAct F32(const float* p) {
  return cuda::CAct(p, cuda::DType::kF32);
}

// x rounded to `dtype` and back (the identity for fp32).
std::vector<float> RoundedTo(const std::vector<float>& x, DType dtype) {
  if (dtype == DType::kF32) return x;
  std::vector<uint8_t> bytes(x.size() * device::DTypeSize(dtype));
  std::vector<float> back(x.size());
  device::ConvertHost(x.data(), DType::kF32, bytes.data(), dtype, x.size());
  device::ConvertHost(bytes.data(), dtype, back.data(), DType::kF32, x.size());
  return back;
}

struct AttentionCase;  // the attention tests' shapes

// ---- the fixture --------------------------------------------------------------------------------

class CudaOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device::DeviceOptions options;
    options.type = device::DeviceType::kCuda;
    Result<std::unique_ptr<device::Device>> created = device::CreateDevice(options);
    if (!created.ok()) GTEST_SKIP() << "no CUDA device: " << created.status().ToString();
    device_ = std::move(created).value();
    ASSERT_OK_AND_ASSIGN(stream_, device_->CreateStream("cuda-ops"));
    ASSERT_OK_AND_ASSIGN(context_, cuda::CreateOpsContext(*stream_));
  }

  void TearDown() override {
    context_.reset();  // waits for the stream
    if (device_ != nullptr) {
      for (void* p : buffers_)
        device_->Free(p);
    }
    stream_.reset();
    device_.reset();
  }

  cuda::OpsContext* context() { return context_.get(); }

  // Defined with the attention tests.
  void CheckAttention(const AttentionCase& c, DType precision, DType cpu_rounding, double out_tol,
                      double grad_tol, uint32_t seed, size_t misalign = 0, DType act = DType::kF32);

  // Device memory for n elements (at least one), freed by TearDown.
  template <typename T>
  T* Alloc(size_t n) {
    Result<void*> p = device_->Alloc(std::max<size_t>(n, 1) * sizeof(T));
    EXPECT_OK(p);
    if (!p.ok()) return nullptr;
    buffers_.push_back(*p);
    return static_cast<T*>(*p);
  }

  // A device copy of `host` (waits for the copy).
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* p = Alloc<T>(host.size());
    if (p != nullptr && !host.empty()) {
      EXPECT_OK(device_->CopyAsync(p, host.data(), host.size() * sizeof(T),
                                   device::CopyKind::kHostToDevice, *stream_));
      EXPECT_OK(device_->Synchronize(*stream_));
    }
    return p;
  }

  // The first n elements at `p`, after the work enqueued so far.
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    std::vector<T> host(n);
    if (n > 0) {
      EXPECT_OK(device_->CopyAsync(host.data(), p, n * sizeof(T), device::CopyKind::kDeviceToHost,
                                   *stream_));
    }
    EXPECT_OK(device_->Synchronize(*stream_));
    return host;
  }

  cuda::Weight Upload(const HostWeight& w) {
    return cuda::ToCudaWeight(cpu::Weight{Upload(w.bytes), w.dtype});
  }

  // A device copy of `host` rounded to `dtype` (fp32: as it is), as an activation.
  cuda::Act UploadAct(const std::vector<float>& host, DType dtype) {
    std::vector<uint8_t> bytes(host.size() * device::DTypeSize(dtype));
    device::ConvertHost(host.data(), DType::kF32, bytes.data(), dtype, host.size());
    return cuda::Act{Upload(bytes), cuda::ToCudaDType(dtype)};
  }

  // Device memory for n activations of `dtype`, freed by TearDown.
  cuda::Act AllocAct(size_t n, DType dtype) {
    return cuda::Act{Alloc<uint8_t>(n * device::DTypeSize(dtype)), cuda::ToCudaDType(dtype)};
  }

  // The first n activations at `x`, widened to fp32 (exact), after the work enqueued so far.
  std::vector<float> DownloadAct(cuda::CAct x, size_t n) {
    const auto dtype = static_cast<DType>(x.dtype);  // the enums are numbered alike
    const std::vector<uint8_t> bytes =
        Download(static_cast<const uint8_t*>(x.data), n * device::DTypeSize(dtype));
    std::vector<float> out(n);
    device::ConvertHost(bytes.data(), dtype, out.data(), DType::kF32, n);
    return out;
  }

  std::unique_ptr<device::Device> device_;
  std::unique_ptr<device::Stream> stream_;
  cuda::OpsContextPtr context_;
  std::vector<void*> buffers_;
};

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

// ---- Embedding ----------------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, EmbeddingMatchesTheCpuBitForBit) {
  struct Size {
    size_t tokens, vocab, hidden;
  };
  // Few ids, so that tokens repeat; 300 tokens span two compaction rounds of the backward.
  for (const Size s : {Size{37, 11, 200}, Size{1, 3, 1}, Size{300, 5, 33}}) {
    const auto tokens = RandomTokens(s.tokens, static_cast<int32_t>(s.vocab), 1);
    const auto w = RandomVector(s.vocab * s.hidden, 2);
    const auto dout = RandomVector(s.tokens * s.hidden, 3);
    const auto dw0 = RandomVector(s.vocab * s.hidden, 4);
    const int32_t* d_tokens = Upload(tokens);
    for (const DType dtype : kDTypes) {
      const HostWeight hw = MakeWeight(w, dtype);
      std::vector<float> out_cpu(s.tokens * s.hidden);
      ASSERT_OK(cpu::EmbeddingForward(tokens.data(), s.tokens, hw.cpu(), s.vocab, s.hidden,
                                      out_cpu.data()));
      float* d_out = Alloc<float>(out_cpu.size());
      ASSERT_OP_OK(cuda::EmbeddingForward(context(), d_tokens, s.tokens, Upload(hw), s.vocab,
                                          s.hidden, F32(d_out)));
      ExpectBitEqual(Label("embedding out", dtype), Download(d_out, out_cpu.size()), out_cpu);
    }
    std::vector<float> dw_cpu = dw0;
    ASSERT_OK(cpu::EmbeddingBackward(tokens.data(), s.tokens, dout.data(), s.vocab, s.hidden,
                                     dw_cpu.data()));
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_tokens, s.tokens, F32(Upload(dout)), s.vocab,
                                         s.hidden, d_dw));
    ExpectBitEqual("embedding dweight (accumulated)", Download(d_dw, dw_cpu.size()), dw_cpu);
    // With a padding token (pad_token_id), whose lookups add nothing.
    std::vector<float> dw_pad_cpu = dw0;
    ASSERT_OK(cpu::EmbeddingBackward(tokens.data(), s.tokens, dout.data(), s.vocab, s.hidden,
                                     dw_pad_cpu.data(), tokens[0]));
    float* d_dw_pad = Upload(dw0);
    ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_tokens, s.tokens, F32(Upload(dout)), s.vocab,
                                         s.hidden, d_dw_pad, tokens[0]));
    ExpectBitEqual("embedding dweight (pad skipped)", Download(d_dw_pad, dw_pad_cpu.size()),
                   dw_pad_cpu);
    EXPECT_OK(cuda::CheckDataErrors(context()));
  }
}

TEST_F(CudaOpsGpuTest, BadTokensAndTargetsAreReportedAsInvalidArgument) {
  const size_t V = 4, H = 3;
  const std::vector<int32_t> bad = {1, 0, 4};
  const float* w = Upload(RandomVector(V * H, 10));
  float* out = Alloc<float>(bad.size() * H);
  const int32_t* d_bad = Upload(bad);
  ASSERT_OP_OK(
      cuda::EmbeddingForward(context(), d_bad, bad.size(), cuda::Weight{w}, V, H, F32(out)));
  Status status = cuda::CheckDataErrors(context());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.ToString().find("token id 4 at position 2 is outside [0, 4)"), std::string::npos)
      << status.ToString();
  EXPECT_OK(cuda::CheckDataErrors(context()));  // the record was cleared

  float* dw = Alloc<float>(V * H);
  ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_bad, bad.size(), F32(out), V, H, dw));
  EXPECT_EQ(cuda::CheckDataErrors(context()).code(), StatusCode::kInvalidArgument);

  const std::vector<int32_t> targets = {cuda::kIgnoreIndex, -1};
  const int32_t* d_targets = Upload(targets);
  const float* logits = Upload(RandomVector(2 * V, 11));
  float* loss = Alloc<float>(1);
  ASSERT_OP_OK(cuda::CrossEntropyForward(context(), F32(logits), d_targets, 2, V,
                                         cuda::kIgnoreIndex, nullptr, loss));
  status = cuda::CheckDataErrors(context());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.ToString().find("target -1 at position 1"), std::string::npos)
      << status.ToString();
  float* lse = Alloc<float>(2);
  float* dlogits = Alloc<float>(2 * V);
  ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), F32(logits), d_targets, lse, 2, V,
                                          cuda::kIgnoreIndex, 1.0f, F32(dlogits)));
  EXPECT_EQ(cuda::CheckDataErrors(context()).code(), StatusCode::kInvalidArgument);
}

// ---- RMSNorm ------------------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, RmsNormMatchesTheCpu) {
  struct Size {
    size_t tokens, hidden;
  };
  // 130 tokens: three partial sums for the weight gradient, the last one short. (No hidden = 1:
  // there dx = r w dy eps / (x^2 + eps) is a cancellation, rounding noise on both sides.)
  for (const Size s : {Size{5, 200}, Size{130, 1000}, Size{1, 3}}) {
    const size_t n = s.tokens * s.hidden;
    const auto x = RandomVector(n, 20);
    const auto w = RandomVector(s.hidden, 21, 0.5f);
    const auto dy = RandomVector(n, 22);
    const auto dw0 = RandomVector(s.hidden, 23);
    const float eps = 1e-5f;
    for (const DType dtype : kDTypes) {
      const HostWeight hw = MakeWeight(w, dtype);
      std::vector<float> y_cpu(n), rstd_cpu(s.tokens), dx_cpu(n), dw_cpu = dw0;
      cpu::RmsNormForward(x.data(), hw.cpu(), s.tokens, s.hidden, eps, y_cpu.data(),
                          rstd_cpu.data());
      cpu::RmsNormBackward(x.data(), hw.cpu(), rstd_cpu.data(), dy.data(), s.tokens, s.hidden,
                           dx_cpu.data(), dw_cpu.data());

      const float* d_x = Upload(x);
      const cuda::Weight d_w = Upload(hw);
      float* d_y = Alloc<float>(n);
      float* d_rstd = Alloc<float>(s.tokens);
      ASSERT_OP_OK(cuda::RmsNormForward(context(), F32(d_x), d_w, s.tokens, s.hidden, eps, F32(d_y),
                                        d_rstd));
      ExpectClose(Label("rmsnorm y", dtype), Download(d_y, n), y_cpu, kF32Tolerance);
      ExpectClose(Label("rmsnorm rstd", dtype), Download(d_rstd, s.tokens), rstd_cpu,
                  kF32Tolerance);
      // In place: dx overwrites dy (the weight gradient must read dy first).
      float* d_dy = Upload(dy);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(cuda::RmsNormBackward(context(), F32(d_x), d_w, d_rstd, F32(d_dy), s.tokens,
                                         s.hidden, F32(d_dy), d_dw));
      ExpectClose(Label("rmsnorm dx (in place)", dtype), Download(d_dy, n), dx_cpu, kF32Tolerance);
      ExpectClose(Label("rmsnorm dweight", dtype), Download(d_dw, s.hidden), dw_cpu, kF32Tolerance);
    }
  }
}

// ---- Linear -------------------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, LinearMatchesTheCpuInEveryWeightDType) {
  struct Size {
    size_t tokens, in, out;
  };
  for (const Size s : {Size{37, 200, 129}, Size{64, 512, 256}, Size{1, 1, 1}}) {
    const auto x = RandomVector(s.tokens * s.in, 30);
    const auto w = RandomVector(s.out * s.in, 31, 0.2f);
    const auto dy = RandomVector(s.tokens * s.out, 32);
    const auto dx0 = RandomVector(s.tokens * s.in, 33);
    const auto dw0 = RandomVector(s.out * s.in, 34);
    for (const DType dtype : kDTypes) {
      const double tol = GemmTolerance(dtype);
      const HostWeight hw = MakeWeight(w, dtype);
      const float* d_x = Upload(x);
      const float* d_dy = Upload(dy);
      const cuda::Weight d_w = Upload(hw);

      std::vector<float> y_cpu(s.tokens * s.out);
      cpu::LinearForward(x.data(), hw.cpu(), s.tokens, s.in, s.out, y_cpu.data());
      float* d_y = Alloc<float>(y_cpu.size());
      ASSERT_OP_OK(cuda::LinearForward(context(), F32(d_x), d_w, s.tokens, s.in, s.out, F32(d_y)));
      ExpectClose(Label("linear y", dtype), Download(d_y, y_cpu.size()), y_cpu, tol);

      // dx overwritten, dweight accumulated.
      std::vector<float> dx_cpu(s.tokens * s.in), dw_cpu = dw0;
      cpu::LinearBackward(x.data(), hw.cpu(), dy.data(), s.tokens, s.in, s.out, dx_cpu.data(),
                          cpu::Accumulate::kOverwrite, dw_cpu.data());
      float* d_dx = Upload(dx0);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(cuda::LinearBackward(context(), F32(d_x), d_w, F32(d_dy), s.tokens, s.in, s.out,
                                        F32(d_dx), cuda::Accumulate::kOverwrite, d_dw));
      ExpectClose(Label("linear dx", dtype), Download(d_dx, dx_cpu.size()), dx_cpu, tol);
      ExpectClose(Label("linear dweight (accumulated)", dtype), Download(d_dw, dw_cpu.size()),
                  dw_cpu, tol);

      // dx accumulated, no weight gradient.
      std::vector<float> dx_add_cpu = dx0;
      cpu::LinearBackward(x.data(), hw.cpu(), dy.data(), s.tokens, s.in, s.out, dx_add_cpu.data(),
                          cpu::Accumulate::kAdd, nullptr);
      float* d_dx_add = Upload(dx0);
      ASSERT_OP_OK(cuda::LinearBackward(context(), F32(d_x), d_w, F32(d_dy), s.tokens, s.in, s.out,
                                        F32(d_dx_add), cuda::Accumulate::kAdd, nullptr));
      ExpectClose(Label("linear dx (accumulated)", dtype), Download(d_dx_add, dx_cpu.size()),
                  dx_add_cpu, tol);
    }
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, RopeMatchesTheCpu) {
  struct Size {
    size_t batch, seq, heads, head_dim;
  };
  for (const Size s : {Size{2, 7, 3, 16}, Size{1, 33, 2, 128}, Size{1, 1, 1, 2}}) {
    const size_t n = s.batch * s.seq * s.heads * s.head_dim;
    const float theta = 10000.0f;
    const auto x = RandomVector(n, 40);
    std::vector<float> fwd_cpu = x, bwd_cpu = x;
    cpu::RopeForward(fwd_cpu.data(), s.batch, s.seq, s.heads, s.head_dim, theta);
    cpu::RopeBackward(bwd_cpu.data(), s.batch, s.seq, s.heads, s.head_dim, theta);
    float* d_fwd = Upload(x);
    float* d_bwd = Upload(x);
    ASSERT_OP_OK(
        cuda::RopeForward(context(), F32(d_fwd), s.batch, s.seq, s.heads, s.head_dim, theta));
    ASSERT_OP_OK(
        cuda::RopeBackward(context(), F32(d_bwd), s.batch, s.seq, s.heads, s.head_dim, theta));
    ExpectClose("rope forward", Download(d_fwd, n), fwd_cpu, kF32Tolerance);
    ExpectClose("rope backward", Download(d_bwd, n), bwd_cpu, kF32Tolerance);
  }
}

// ---- Attention ----------------------------------------------------------------------------------

struct AttentionCase {
  size_t batch, seq, heads, kv_heads, head_dim;
  std::string Name() const {
    return "b" + std::to_string(batch) + " s" + std::to_string(seq) + " h" +
           std::to_string(heads) + "/" + std::to_string(kv_heads) + " d" +
           std::to_string(head_dim);
  }
};

// Attention forward and backward of `c` on the GPU in `precision` against the CPU, whose q, k, v
// and dout are first rounded to `cpu_rounding` (what the GPU kernels see): the output and lse
// within out_tol, the gradients within grad_tol. dq, dk and dv start as garbage (they are
// overwritten), and a second run gives the same bits. `act`: the activations' dtype (fp32, or
// `precision`), in which q, k, v and dout are uploaded and out, dq, dk and dv stored; with 16 bits
// the CPU's backward reads the GPU's (rounded) output, as the GPU's backward does.
void CudaOpsGpuTest::CheckAttention(const AttentionCase& c, DType precision, DType cpu_rounding,
                                    double out_tol, double grad_tol, uint32_t seed, size_t misalign,
                                    DType act) {
  const std::string shape =
      Label(c.Name(), precision) +
      (act == DType::kF32 ? "" : ", " + std::string(device::DTypeName(act)) + " activations");
  const size_t q_n = c.batch * c.seq * c.heads * c.head_dim;
  const size_t kv_n = c.batch * c.seq * c.kv_heads * c.head_dim;
  const size_t lse_n = c.batch * c.heads * c.seq;
  const auto q = RandomVector(q_n, seed);
  const auto k = RandomVector(kv_n, seed + 1);
  const auto v = RandomVector(kv_n, seed + 2);
  const auto dout = RandomVector(q_n, seed + 3);
  const auto rq = RoundedTo(q, cpu_rounding), rk = RoundedTo(k, cpu_rounding),
             rv = RoundedTo(v, cpu_rounding), rdout = RoundedTo(dout, cpu_rounding);
  std::vector<float> out_cpu(q_n), lse_cpu(lse_n), dq_cpu(q_n), dk_cpu(kv_n), dv_cpu(kv_n);
  cpu::AttentionForward(rq.data(), rk.data(), rv.data(), c.batch, c.seq, c.heads, c.kv_heads,
                        c.head_dim, out_cpu.data(), lse_cpu.data());

  const cuda::DType p = cuda::ToCudaDType(precision);
  // misalign > 0: the inputs start that many elements into their buffers (off the 16-byte
  // alignment the tiled kernels' vector loads and cuDNN need; they must fall back to scalar loads,
  // or to Strata's kernels).
  auto upload_at = [&](const std::vector<float>& x) {
    std::vector<float> padded(misalign, 0.0f);
    padded.insert(padded.end(), x.begin(), x.end());
    const cuda::Act a = UploadAct(padded, act);
    return cuda::CAct(static_cast<const char*>(a.data) + misalign * device::DTypeSize(act),
                      a.dtype);
  };
  const cuda::CAct d_q = upload_at(q);
  const cuda::CAct d_k = upload_at(k);
  const cuda::CAct d_v = upload_at(v);
  const cuda::CAct d_dout = upload_at(dout);
  const cuda::Act d_out = AllocAct(q_n, act);
  float* d_lse = Alloc<float>(lse_n);
  const cuda::Act d_dq = UploadAct(RandomVector(q_n, seed + 4), act);
  const cuda::Act d_dk = UploadAct(RandomVector(kv_n, seed + 5), act);
  const cuda::Act d_dv = UploadAct(RandomVector(kv_n, seed + 6), act);
  auto forward = [&] {
    return cuda::AttentionForward(context(), d_q, d_k, d_v, c.batch, c.seq, c.heads, c.kv_heads,
                                  c.head_dim, d_out, d_lse, p);
  };
  auto backward = [&] {
    return cuda::AttentionBackward(context(), d_q, d_k, d_v, d_out, d_lse, d_dout, c.batch, c.seq,
                                   c.heads, c.kv_heads, c.head_dim, d_dq, d_dk, d_dv, p);
  };
  ASSERT_OP_OK(forward());
  const std::vector<float> out_gpu = DownloadAct(d_out, q_n);
  ExpectClose("attention out " + shape, out_gpu, out_cpu, out_tol);
  ExpectClose("attention lse " + shape, Download(d_lse, lse_n), lse_cpu, out_tol);

  const std::vector<float>& out_seen = act == DType::kF32 ? out_cpu : out_gpu;
  cpu::AttentionBackward(rq.data(), rk.data(), rv.data(), out_seen.data(), lse_cpu.data(),
                         rdout.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                         dq_cpu.data(), dk_cpu.data(), dv_cpu.data());
  ASSERT_OP_OK(backward());
  const std::vector<float> dq_gpu = DownloadAct(d_dq, q_n);
  const std::vector<float> dk_gpu = DownloadAct(d_dk, kv_n);
  const std::vector<float> dv_gpu = DownloadAct(d_dv, kv_n);
  ExpectClose("attention dq " + shape, dq_gpu, dq_cpu, grad_tol);
  ExpectClose("attention dk " + shape, dk_gpu, dk_cpu, grad_tol);
  ExpectClose("attention dv " + shape, dv_gpu, dv_cpu, grad_tol);

  ASSERT_OP_OK(forward());
  ExpectBitEqual("attention out rerun " + shape, DownloadAct(d_out, q_n), out_gpu);
  ASSERT_OP_OK(backward());
  ExpectBitEqual("attention dq rerun " + shape, DownloadAct(d_dq, q_n), dq_gpu);
  ExpectBitEqual("attention dk rerun " + shape, DownloadAct(d_dk, kv_n), dk_gpu);
  ExpectBitEqual("attention dv rerun " + shape, DownloadAct(d_dv, kv_n), dv_gpu);
}

TEST_F(CudaOpsGpuTest, AttentionMatchesTheCpuAndIsDeterministic) {
  // Head dims cover each register tile (<= 32, 64, 128, 256 per warp), full and partial; the
  // head counts cover multi-head, grouped-query and multi-query attention. (No seq = 1: its
  // gradients are pure rounding noise, dS = P (dO.V - dO.O) with P = 1 and O = V.)
  for (const AttentionCase& c : {AttentionCase{2, 7, 4, 2, 16}, AttentionCase{1, 33, 4, 1, 64},
                                 AttentionCase{2, 20, 2, 2, 72}, AttentionCase{1, 9, 2, 1, 256},
                                 AttentionCase{1, 2, 1, 1, 2}}) {
    CheckAttention(c, DType::kF32, DType::kF32, kF32Tolerance, kF32Tolerance, 50);
  }
}

// The tensor-core kernels (16-bit precision, head_dim 64 and 128). The CPU reference runs on q, k,
// v and dout rounded to the same dtype, so what remains is the rounding of the probabilities (and
// dS) to 16 bits before the second product of each pair, and the order of the fp32 sums:
// 1e-2 of the largest element for the output and lse, 3e-2 (bf16) or 1e-2 (fp16) for the
// gradients. Shapes cover one exact tile, partial tiles (seq 100, 130, 3), grouped-query and
// multi-query heads. A head_dim the tiled kernels do not take (72) runs the exact kernels.
// Sets STRATA_ATTENTION for one scope (cuda_ops.h: which attention kernels run).
class AttentionSwitch {
 public:
  explicit AttentionSwitch(const char* value) { ::setenv("STRATA_ATTENTION", value, 1); }
  ~AttentionSwitch() { ::unsetenv("STRATA_ATTENTION"); }
  AttentionSwitch(const AttentionSwitch&) = delete;
  AttentionSwitch& operator=(const AttentionSwitch&) = delete;
};

TEST_F(CudaOpsGpuTest, AttentionOnTensorCoresMatchesTheCpuOnRoundedInputs) {
  const AttentionSwitch kernels("kernels");  // Strata's own, not cuDNN's
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const double grad_tol = dtype == DType::kBF16 ? 3e-2 : 1e-2;
    for (const AttentionCase& c :
         {AttentionCase{1, 64, 2, 2, 64}, AttentionCase{2, 100, 4, 2, 64},
          AttentionCase{1, 130, 2, 1, 128}, AttentionCase{1, 3, 2, 1, 128},
          AttentionCase{1, 20, 2, 2, 72}}) {
      if (c.head_dim == 64 || c.head_dim == 128) {
        CheckAttention(c, dtype, dtype, 1e-2, grad_tol, 60);
        if (c.seq == 100) CheckAttention(c, dtype, dtype, 1e-2, grad_tol, 61, /*misalign=*/1);
      } else {
        CheckAttention(c, dtype, DType::kF32, kF32Tolerance, kF32Tolerance, 60);
      }
    }
  }
}

// cuDNN's fused attention (cuda_cudnn_attention.h), where a cuDNN 9 is found (on the GPU check's
// machine: PyTorch's), against the CPU on rounded inputs with the tiled kernels' tolerances: one
// tile, partial tiles, grouped-query and multi-query heads, and the benchmarks' head layouts
// (llama-1b's 32/4 at d64, an 8B-class 32/8 at d128) at a sequence the CPU reference can afford.
// CheckAttention's rerun holds the backward to the same bits (cuDNN's deterministic algorithm).
// Packed documents stay on the exact kernels.
TEST_F(CudaOpsGpuTest, AttentionFromCudnnMatchesTheCpuOnRoundedInputs) {
  const char* first = cuda::PrepareAttention(context(), 1, 64, 2, 2, 64, cuda::DType::kBF16);
  if (std::string(first) != "cudnn") {
    const Result<cudnn::Library>& lib = cudnn::ProcessLibrary();
    GTEST_SKIP() << "cuDNN's attention is not available here ("
                 << (lib.ok() ? "loaded, but the GPU or the shape is not supported; see the log"
                              : lib.status().ToString())
                 << ")";
  }
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const double grad_tol = dtype == DType::kBF16 ? 3e-2 : 1e-2;
    const cuda::DType p = cuda::ToCudaDType(dtype);
    for (const AttentionCase& c :
         {AttentionCase{1, 64, 2, 2, 64}, AttentionCase{2, 100, 4, 2, 64},
          AttentionCase{1, 130, 2, 1, 128}, AttentionCase{1, 3, 2, 1, 128},
          AttentionCase{1, 512, 32, 4, 64}, AttentionCase{1, 256, 32, 8, 128}}) {
      ASSERT_STREQ(
          cuda::PrepareAttention(context(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, p),
          "cudnn")
          << Label(c.Name(), dtype);
      CheckAttention(c, dtype, dtype, 1e-2, grad_tol, 70);
    }
  }
  EXPECT_STREQ(cuda::PrepareAttention(context(), 1, 64, 2, 2, 64, cuda::DType::kBF16,
                                      /*packed_documents=*/true),
               "exact");
  const AttentionSwitch kernels("kernels");
  EXPECT_STREQ(cuda::PrepareAttention(context(), 1, 64, 2, 2, 64, cuda::DType::kBF16),
               "tensor cores");
}

TEST_F(CudaOpsGpuTest, UnsupportedShapesAreInvalidArgument) {
  float* buffer = Alloc<float>(1024);
  const cuda::Act act = F32(buffer);
  EXPECT_EQ(cuda::ToStatus(cuda::AttentionForward(context(), act, act, act, 1, 1, 1, 1,
                                                  cuda::kMaxAttentionHeadDim + 2, act, buffer))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cuda::ToStatus(cuda::AttentionForward(context(), act, act, act, 1, 1, 3, 2, 8, act, buffer))
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::ToStatus(cuda::RopeForward(context(), act, 1, 1, 1, 3, 10000.0f)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::ToStatus(cuda::LinearForward(context(), act,
                                               cuda::Weight{buffer, static_cast<cuda::DType>(7)}, 1,
                                               1, 1, act))
                .code(),
            StatusCode::kInvalidArgument);
}

// ---- SwiGLU, residual ---------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, SiluMulMatchesTheCpu) {
  for (const size_t n : {size_t{1000}, size_t{1}, size_t{257}}) {
    const auto gate = RandomVector(n, 60, 4.0f);  // into both tails of the sigmoid
    const auto up = RandomVector(n, 61);
    const auto dh = RandomVector(n, 62);
    std::vector<float> h_cpu(n), dgate_cpu(n), dup_cpu(n);
    cpu::SiluMulForward(gate.data(), up.data(), n, h_cpu.data());
    cpu::SiluMulBackward(gate.data(), up.data(), dh.data(), n, dgate_cpu.data(), dup_cpu.data());
    const float* d_gate = Upload(gate);
    const float* d_up = Upload(up);
    float* d_h = Alloc<float>(n);
    ASSERT_OP_OK(cuda::SiluMulForward(context(), F32(d_gate), F32(d_up), n, F32(d_h)));
    ExpectClose("silu_mul h", Download(d_h, n), h_cpu, kF32Tolerance);
    // dgate written over dh, as the contract allows.
    float* d_dh = Upload(dh);
    float* d_dup = Alloc<float>(n);
    ASSERT_OP_OK(cuda::SiluMulBackward(context(), F32(d_gate), F32(d_up), F32(d_dh), n, F32(d_dh),
                                       F32(d_dup)));
    ExpectClose("silu_mul dgate (over dh)", Download(d_dh, n), dgate_cpu, kF32Tolerance);
    ExpectClose("silu_mul dup", Download(d_dup, n), dup_cpu, kF32Tolerance);
  }
}

TEST_F(CudaOpsGpuTest, ResidualAndAccumulateMatchTheCpuBitForBit) {
  for (const size_t n : {size_t{1000}, size_t{1}, size_t{1u << 20}}) {
    const auto a = RandomVector(n, 70);
    const auto b = RandomVector(n, 71);
    std::vector<float> y_cpu(n), acc_cpu = a;
    cpu::ResidualAdd(a.data(), b.data(), n, y_cpu.data());
    cpu::AccumulateGradient(b.data(), n, acc_cpu.data());
    float* d_a = Upload(a);
    const float* d_b = Upload(b);
    float* d_y = Alloc<float>(n);
    ASSERT_OP_OK(cuda::ResidualAdd(context(), F32(d_a), F32(d_b), n, F32(d_y)));
    ExpectBitEqual("residual y", Download(d_y, n), y_cpu);
    ASSERT_OP_OK(cuda::AccumulateGradient(context(), F32(d_b), n, F32(d_a)));
    ExpectBitEqual("accumulated gradient", Download(d_a, n), acc_cpu);
  }
}

// ---- Cross-entropy ------------------------------------------------------------------------------

TEST_F(CudaOpsGpuTest, CrossEntropyMatchesTheCpu) {
  struct Size {
    size_t tokens, vocab;
  };
  for (const Size s : {Size{37, 1000}, Size{300, 33}, Size{1, 1}}) {
    const size_t n = s.tokens * s.vocab;
    const auto logits = RandomVector(n, 80, 3.0f);
    auto targets = RandomTokens(s.tokens, static_cast<int32_t>(s.vocab), 81);
    for (size_t t = 0; t < s.tokens; t += 5)
      targets[t] = cpu::kIgnoreIndex;
    if (s.tokens == 1) targets[0] = 0;
    const float dloss = 1.7f;

    std::vector<float> lse_cpu(s.tokens), dlogits_cpu(n);
    ASSERT_OK_AND_ASSIGN(const float loss_cpu,
                         cpu::CrossEntropyForward(logits.data(), targets.data(), s.tokens, s.vocab,
                                                  cpu::kIgnoreIndex, lse_cpu.data()));
    ASSERT_OK(cpu::CrossEntropyBackward(logits.data(), targets.data(), lse_cpu.data(), s.tokens,
                                        s.vocab, cpu::kIgnoreIndex, dloss, dlogits_cpu.data()));

    float* d_logits = Upload(logits);
    const int32_t* d_targets = Upload(targets);
    float* d_lse = Alloc<float>(s.tokens);
    float* d_loss = Alloc<float>(1);
    ASSERT_OP_OK(cuda::CrossEntropyForward(context(), F32(d_logits), d_targets, s.tokens, s.vocab,
                                           cuda::kIgnoreIndex, d_lse, d_loss));
    ExpectClose("cross-entropy loss", Download(d_loss, 1), {loss_cpu}, kF32Tolerance);
    ExpectClose("cross-entropy lse", Download(d_lse, s.tokens), lse_cpu, kF32Tolerance);
    float* d_dlogits = Alloc<float>(n);
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), F32(d_logits), d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, F32(d_dlogits)));
    ExpectClose("cross-entropy dlogits", Download(d_dlogits, n), dlogits_cpu, kF32Tolerance);
    // In place over the logits.
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), F32(d_logits), d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, F32(d_logits)));
    ExpectClose("cross-entropy dlogits (in place)", Download(d_logits, n), dlogits_cpu,
                kF32Tolerance);
    EXPECT_OK(cuda::CheckDataErrors(context()));
  }
}

TEST_F(CudaOpsGpuTest, CrossEntropyWithEveryTargetIgnoredIsZero) {
  const size_t T = 3, V = 5;
  const float* logits = Upload(RandomVector(T * V, 90));
  const int32_t* targets = Upload(std::vector<int32_t>(T, cuda::kIgnoreIndex));
  float* lse = Alloc<float>(T);
  float* loss = Upload(std::vector<float>{42.0f});
  float* dlogits = Upload(std::vector<float>(T * V, 1.0f));
  ASSERT_OP_OK(cuda::CrossEntropyForward(context(), F32(logits), targets, T, V, cuda::kIgnoreIndex,
                                         lse, loss));
  ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), F32(logits), targets, lse, T, V,
                                          cuda::kIgnoreIndex, 1.0f, F32(dlogits)));
  EXPECT_EQ(Download(loss, 1)[0], 0.0f);
  for (float g : Download(dlogits, T * V))
    EXPECT_EQ(g, 0.0f);
}

// Tensor parallelism's vocabulary split: each of 3 ranks' shard ops on the GPU against the CPU's,
// with repeated tokens, a padding token, ignored targets and targets of other ranks. The
// embedding is bit for bit (as the whole one); the cross-entropy within the fp32 tolerance.
TEST_F(CudaOpsGpuTest, VocabularyShardOpsMatchTheCpu) {
  const size_t T = 45, V = 36, H = 40, ranks = 3, part = V / ranks;
  const auto tokens = RandomTokens(T, static_cast<int32_t>(V), 101);
  auto targets = RandomTokens(T, static_cast<int32_t>(V), 102);
  for (size_t t = 0; t < T; t += 7)
    targets[t] = cpu::kIgnoreIndex;
  const auto logits_all = RandomVector(T * V, 103, 3.0f);
  const auto dout = RandomVector(T * H, 104);
  const float dloss = 0.9f;
  const int32_t* d_tokens = Upload(tokens);
  const int32_t* d_targets = Upload(targets);
  for (size_t r = 0; r < ranks; ++r) {
    const size_t begin = r * part;
    const std::string rank = " (rank " + std::to_string(r) + ")";
    // The embedding's rows [begin, begin + part).
    const auto w = RandomVector(part * H, 105 + r);
    for (const DType dtype : kDTypes) {
      const HostWeight hw = MakeWeight(w, dtype);
      std::vector<float> out_cpu(T * H);
      cpu::ShardEmbeddingForward(tokens.data(), T, hw.cpu(), begin, part, H, out_cpu.data());
      float* d_out = Alloc<float>(out_cpu.size());
      ASSERT_OP_OK(cuda::ShardEmbeddingForward(context(), d_tokens, T, Upload(hw), begin, part, H,
                                               F32(d_out)));
      ExpectBitEqual(Label("shard embedding out" + rank, dtype), Download(d_out, T * H), out_cpu);
    }
    const auto dw0 = RandomVector(part * H, 110 + r);
    std::vector<float> dw_cpu = dw0;
    cpu::ShardEmbeddingBackward(tokens.data(), T, dout.data(), begin, part, H, dw_cpu.data(),
                                tokens[1]);
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::ShardEmbeddingBackward(context(), d_tokens, T, F32(Upload(dout)), begin,
                                              part, H, d_dw, tokens[1]));
    ExpectBitEqual("shard embedding dweight" + rank, Download(d_dw, dw_cpu.size()), dw_cpu);

    // The cross-entropy's three steps on the rank's columns [begin, begin + part) of every row,
    // each rank alone (the all-reduces between them are the model's, tested there).
    std::vector<float> logits(T * part);
    for (size_t t = 0; t < T; ++t) {
      std::copy_n(logits_all.begin() + static_cast<std::ptrdiff_t>(t * V + begin), part,
                  logits.begin() + static_cast<std::ptrdiff_t>(t * part));
    }
    std::vector<float> max_cpu(T), sums_cpu(2 * T), lse_cpu(T), dlogits_cpu(T * part);
    cpu::CrossEntropyShardMax(logits.data(), T, part, max_cpu.data());
    cpu::CrossEntropyShardSums(logits.data(), targets.data(), T, begin, part, cpu::kIgnoreIndex,
                               max_cpu.data(), sums_cpu.data());
    const float loss_cpu = cpu::CrossEntropyShardFinish(
        targets.data(), T, cpu::kIgnoreIndex, max_cpu.data(), sums_cpu.data(), lse_cpu.data());
    cpu::CrossEntropyShardBackward(logits.data(), targets.data(), lse_cpu.data(), T, begin, part,
                                   cpu::kIgnoreIndex, dloss, dlogits_cpu.data());
    float* d_logits = Upload(logits);
    float* d_max = Alloc<float>(T);
    float* d_sums = Alloc<float>(2 * T);
    float* d_lse = Alloc<float>(T);
    float* d_loss = Alloc<float>(1);
    ASSERT_OP_OK(cuda::CrossEntropyShardMax(context(), F32(d_logits), T, part, d_max));
    ExpectBitEqual("shard cross-entropy max" + rank, Download(d_max, T), max_cpu);
    ASSERT_OP_OK(cuda::CrossEntropyShardSums(context(), F32(d_logits), d_targets, T, begin, part,
                                             cuda::kIgnoreIndex, d_max, d_sums));
    ExpectClose("shard cross-entropy sums" + rank, Download(d_sums, 2 * T), sums_cpu,
                kF32Tolerance);
    ASSERT_OP_OK(cuda::CrossEntropyShardFinish(context(), d_targets, T, cuda::kIgnoreIndex, d_max,
                                               d_sums, d_lse, d_loss));
    ExpectClose("shard cross-entropy loss" + rank, Download(d_loss, 1), {loss_cpu}, kF32Tolerance);
    ExpectClose("shard cross-entropy lse" + rank, Download(d_lse, T), lse_cpu, kF32Tolerance);
    ASSERT_OP_OK(cuda::CrossEntropyShardBackward(context(), F32(d_logits), d_targets, d_lse, T,
                                                 begin, part, cuda::kIgnoreIndex, dloss,
                                                 F32(d_logits)));
    ExpectClose("shard cross-entropy dlogits (in place)" + rank, Download(d_logits, T * part),
                dlogits_cpu, kF32Tolerance);
  }
  EXPECT_OK(cuda::CheckDataErrors(context()));
}

// ---- 16-bit activations -------------------------------------------------------------------------

// The tolerance of an output stored in `out` by arithmetic on inputs of `gemm` (a linear layer's
// weight dtype; fp32 for the other ops), against the CPU on the same rounded inputs (see the top).
double StoredTolerance(DType out, DType gemm = DType::kF32) {
  if (out == DType::kBF16) return kBf16Tolerance;
  if (out == DType::kF16) return kF16Tolerance;
  return gemm == DType::kF32 ? kF32Tolerance : kF32From16BitGemmTolerance;
}

constexpr DType kBF16 = DType::kBF16;

TEST_F(CudaOpsGpuTest, Bf16ActivationsEmbeddingMatchesTheCpuBitForBit) {
  struct Size {
    size_t tokens, vocab, hidden;
  };
  for (const Size s : {Size{37, 11, 200}, Size{1, 3, 1}, Size{300, 5, 33}}) {
    const auto tokens = RandomTokens(s.tokens, static_cast<int32_t>(s.vocab), 1);
    const auto w = RandomVector(s.vocab * s.hidden, 2);
    const auto dout = RoundedTo(RandomVector(s.tokens * s.hidden, 3), kBF16);
    const auto dw0 = RandomVector(s.vocab * s.hidden, 4);
    const int32_t* d_tokens = Upload(tokens);
    for (const DType dtype : kDTypes) {
      const HostWeight hw = MakeWeight(w, dtype);
      std::vector<float> out_cpu(s.tokens * s.hidden);
      ASSERT_OK(cpu::EmbeddingForward(tokens.data(), s.tokens, hw.cpu(), s.vocab, s.hidden,
                                      out_cpu.data()));
      const cuda::Act d_out = AllocAct(out_cpu.size(), kBF16);
      ASSERT_OP_OK(cuda::EmbeddingForward(context(), d_tokens, s.tokens, Upload(hw), s.vocab,
                                          s.hidden, d_out));
      ExpectBitEqual(Label("embedding out (bf16 activations)", dtype),
                     DownloadAct(d_out, out_cpu.size()), RoundedTo(out_cpu, kBF16));
    }
    std::vector<float> dw_cpu = dw0;
    ASSERT_OK(cpu::EmbeddingBackward(tokens.data(), s.tokens, dout.data(), s.vocab, s.hidden,
                                     dw_cpu.data()));
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_tokens, s.tokens, UploadAct(dout, kBF16),
                                         s.vocab, s.hidden, d_dw));
    ExpectBitEqual("embedding dweight (bf16 dout)", Download(d_dw, dw_cpu.size()), dw_cpu);
    EXPECT_OK(cuda::CheckDataErrors(context()));
  }
}

TEST_F(CudaOpsGpuTest, Bf16ActivationsRmsNormMatchesTheCpuOnRoundedInputs) {
  struct Size {
    size_t tokens, hidden;
  };
  for (const Size s : {Size{5, 200}, Size{130, 1000}, Size{1, 3}}) {
    const size_t n = s.tokens * s.hidden;
    const auto x = RoundedTo(RandomVector(n, 20), kBF16);
    const auto w = RandomVector(s.hidden, 21, 0.5f);
    const auto dy = RoundedTo(RandomVector(n, 22), kBF16);
    const auto dw0 = RandomVector(s.hidden, 23);
    const float eps = 1e-5f;
    for (const DType dtype : kDTypes) {
      const HostWeight hw = MakeWeight(w, dtype);
      std::vector<float> y_cpu(n), rstd_cpu(s.tokens), dx_cpu(n), dw_cpu = dw0;
      cpu::RmsNormForward(x.data(), hw.cpu(), s.tokens, s.hidden, eps, y_cpu.data(),
                          rstd_cpu.data());
      cpu::RmsNormBackward(x.data(), hw.cpu(), rstd_cpu.data(), dy.data(), s.tokens, s.hidden,
                           dx_cpu.data(), dw_cpu.data());
      const cuda::Act d_x = UploadAct(x, kBF16);
      const cuda::Weight d_w = Upload(hw);
      const cuda::Act d_y = AllocAct(n, kBF16);
      float* d_rstd = Alloc<float>(s.tokens);
      ASSERT_OP_OK(cuda::RmsNormForward(context(), d_x, d_w, s.tokens, s.hidden, eps, d_y, d_rstd));
      ExpectClose(Label("rmsnorm y (bf16)", dtype), DownloadAct(d_y, n), y_cpu, kBf16Tolerance);
      ExpectClose(Label("rmsnorm rstd (bf16 x)", dtype), Download(d_rstd, s.tokens), rstd_cpu,
                  kF32Tolerance);
      // In place: dx overwrites dy.
      const cuda::Act d_dy = UploadAct(dy, kBF16);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(
          cuda::RmsNormBackward(context(), d_x, d_w, d_rstd, d_dy, s.tokens, s.hidden, d_dy, d_dw));
      ExpectClose(Label("rmsnorm dx (bf16, in place)", dtype), DownloadAct(d_dy, n), dx_cpu,
                  kBf16Tolerance);
      ExpectClose(Label("rmsnorm dweight (bf16 x, dy)", dtype), Download(d_dw, s.hidden), dw_cpu,
                  kF32Tolerance);
    }
  }
}

// The fused residual add and norm (and the norm's backward with the residual path's gradient)
// against the CPU's two ops, in fp32 and with bf16 activations; and against the GPU's own two
// ops bit for bit (the forward in both dtypes; the backward in fp32, where rounding dx once or
// twice is the same).
TEST_F(CudaOpsGpuTest, FusedResidualAndRmsNormMatchTheirTwoOps) {
  const size_t T = 70, H = 300, n = T * H;
  const float eps = 1e-5f;
  for (const DType act : {DType::kF32, kBF16}) {
    const auto a = RoundedTo(RandomVector(n, 120), act);
    const auto b = RoundedTo(RandomVector(n, 121), act);
    const auto dy = RoundedTo(RandomVector(n, 122), act);
    const auto residual = RoundedTo(RandomVector(n, 123), act);
    const auto dw0 = RandomVector(H, 124);
    const HostWeight hw = MakeWeight(RandomVector(H, 125, 0.5f), kBF16);
    const cuda::Weight d_w = Upload(hw);
    const std::string tag = act == DType::kF32 ? " (fp32)" : " (bf16 activations)";

    // The CPU: the sum as stored (rounded to the activations' dtype), then the norm of it.
    std::vector<float> sum_cpu(n), y_cpu(n), rstd_cpu(T), dx_cpu(n), dw_cpu = dw0;
    cpu::ResidualAdd(a.data(), b.data(), n, sum_cpu.data());
    sum_cpu = RoundedTo(sum_cpu, act);
    cpu::RmsNormForward(sum_cpu.data(), hw.cpu(), T, H, eps, y_cpu.data(), rstd_cpu.data());
    cpu::RmsNormBackward(sum_cpu.data(), hw.cpu(), rstd_cpu.data(), dy.data(), T, H, dx_cpu.data(),
                         dw_cpu.data());
    cpu::AccumulateGradient(residual.data(), n, dx_cpu.data());

    // Fused, the sum over b (its input, as the model writes x2).
    const cuda::Act d_a = UploadAct(a, act);
    const cuda::Act d_sum = UploadAct(b, act);
    const cuda::Act d_y = AllocAct(n, act);
    float* d_rstd = Alloc<float>(T);
    ASSERT_OP_OK(
        cuda::ResidualRmsNormForward(context(), d_a, d_sum, d_w, T, H, eps, d_sum, d_y, d_rstd));
    const std::vector<float> sum_gpu = DownloadAct(d_sum, n);
    const std::vector<float> y_gpu = DownloadAct(d_y, n);
    const std::vector<float> rstd_gpu = Download(d_rstd, T);
    ExpectBitEqual("fused residual sum" + tag, sum_gpu, sum_cpu);
    ExpectClose("fused norm y" + tag, y_gpu, y_cpu, StoredTolerance(act));
    ExpectClose("fused norm rstd" + tag, rstd_gpu, rstd_cpu, kF32Tolerance);
    // The GPU's two ops.
    const cuda::Act d_sum2 = AllocAct(n, act);
    const cuda::Act d_y2 = AllocAct(n, act);
    float* d_rstd2 = Alloc<float>(T);
    ASSERT_OP_OK(cuda::ResidualAdd(context(), d_a, UploadAct(b, act), n, d_sum2));
    ASSERT_OP_OK(cuda::RmsNormForward(context(), d_sum2, d_w, T, H, eps, d_y2, d_rstd2));
    ExpectBitEqual("fused norm y against two ops" + tag, DownloadAct(d_y2, n), y_gpu);
    ExpectBitEqual("fused norm rstd against two ops" + tag, Download(d_rstd2, T), rstd_gpu);

    // Backward, dx over dy.
    const cuda::Act d_dy = UploadAct(dy, act);
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::RmsNormResidualBackward(context(), d_sum, d_w, d_rstd, d_dy,
                                               UploadAct(residual, act), T, H, d_dy, d_dw));
    const std::vector<float> dx_gpu = DownloadAct(d_dy, n);
    ExpectClose("norm + residual dx" + tag, dx_gpu, dx_cpu, StoredTolerance(act));
    ExpectClose("norm + residual dweight" + tag, Download(d_dw, H), dw_cpu, kF32Tolerance);
    if (act == DType::kF32) {
      const cuda::Act d_dx2 = AllocAct(n, act);
      ASSERT_OP_OK(cuda::RmsNormBackward(context(), d_sum, d_w, d_rstd, UploadAct(dy, act), T, H,
                                         d_dx2, nullptr));
      ASSERT_OP_OK(cuda::AccumulateGradient(context(), UploadAct(residual, act), n, d_dx2));
      ExpectBitEqual("norm + residual dx against two ops" + tag, DownloadAct(d_dx2, n), dx_gpu);
    }
  }
}

// Linear layers with activations of other dtypes than fp32: x, y (and dy), dx in the given
// dtypes and a weight of `weight_dtype`, against the CPU on the inputs as the GEMMs see them
// (rounded to the activation's dtype, then to the weight's when that is 16-bit).
struct LinearCase {
  DType weight, x, y, dx;  // dy has y's dtype
  std::string Name() const {
    return std::string("weight ") + std::string(device::DTypeName(weight)) + ", x " +
           std::string(device::DTypeName(x)) + ", y/dy " + std::string(device::DTypeName(y)) +
           ", dx " + std::string(device::DTypeName(dx));
  }
};

TEST_F(CudaOpsGpuTest, Bf16ActivationsLinearMatchesTheCpuOnRoundedInputs) {
  struct Size {
    size_t tokens, in, out;
  };
  // The model's case (bf16 weight and activations: no copies, bf16 outputs from cuBLAS), fp32 x
  // rounded for a bf16 weight, fp32 outputs of bf16 inputs, 16-bit activations on an fp32 weight
  // (widened copies, outputs staged in fp32 and rounded), and fp16 activations on a bf16 weight
  // (converted copies, fp16 outputs staged).
  const LinearCase cases[] = {{kBF16, kBF16, kBF16, kBF16},
                              {kBF16, DType::kF32, kBF16, kBF16},
                              {kBF16, kBF16, DType::kF32, DType::kF32},
                              {DType::kF32, kBF16, kBF16, kBF16},
                              {kBF16, DType::kF16, DType::kF16, DType::kF16}};
  for (const Size s : {Size{37, 200, 129}, Size{64, 512, 256}, Size{1, 1, 1}}) {
    for (const LinearCase& c : cases) {
      const std::string name = c.Name() + " [" + std::to_string(s.tokens) + "x" +
                               std::to_string(s.in) + "x" + std::to_string(s.out) + "]";
      // Inputs as stored (rounded to the activation's dtype) and as the GEMMs read them.
      const auto x = RoundedTo(RandomVector(s.tokens * s.in, 30), c.x);
      const auto dy = RoundedTo(RandomVector(s.tokens * s.out, 32), c.y);
      const auto dx0 = RoundedTo(RandomVector(s.tokens * s.in, 33), c.dx);
      const auto dw0 = RandomVector(s.out * s.in, 34);
      const auto x_gemm = RoundedTo(x, c.weight);
      const auto dy_gemm = RoundedTo(dy, c.weight);
      const HostWeight hw = MakeWeight(RandomVector(s.out * s.in, 31, 0.2f), c.weight);
      const cuda::Weight d_w = Upload(hw);
      const cuda::Act d_x = UploadAct(x, c.x);
      const cuda::Act d_dy = UploadAct(dy, c.y);

      std::vector<float> y_cpu(s.tokens * s.out);
      cpu::LinearForward(x_gemm.data(), hw.cpu(), s.tokens, s.in, s.out, y_cpu.data());
      const cuda::Act d_y = AllocAct(y_cpu.size(), c.y);
      ASSERT_OP_OK(cuda::LinearForward(context(), d_x, d_w, s.tokens, s.in, s.out, d_y));
      ExpectClose("linear y, " + name, DownloadAct(d_y, y_cpu.size()), y_cpu,
                  StoredTolerance(c.y, c.weight));

      // dx overwritten, dweight accumulated.
      std::vector<float> dx_cpu(s.tokens * s.in), dw_cpu = dw0;
      cpu::LinearBackward(x_gemm.data(), hw.cpu(), dy_gemm.data(), s.tokens, s.in, s.out,
                          dx_cpu.data(), cpu::Accumulate::kOverwrite, dw_cpu.data());
      const cuda::Act d_dx = UploadAct(dx0, c.dx);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(cuda::LinearBackward(context(), d_x, d_w, d_dy, s.tokens, s.in, s.out, d_dx,
                                        cuda::Accumulate::kOverwrite, d_dw));
      ExpectClose("linear dx, " + name, DownloadAct(d_dx, dx_cpu.size()), dx_cpu,
                  StoredTolerance(c.dx, c.weight));
      ExpectClose("linear dweight (accumulated), " + name, Download(d_dw, dw_cpu.size()), dw_cpu,
                  StoredTolerance(DType::kF32, c.weight));

      // dx accumulated, no weight gradient.
      std::vector<float> dx_add_cpu = dx0;
      cpu::LinearBackward(x_gemm.data(), hw.cpu(), dy_gemm.data(), s.tokens, s.in, s.out,
                          dx_add_cpu.data(), cpu::Accumulate::kAdd, nullptr);
      const cuda::Act d_dx_add = UploadAct(dx0, c.dx);
      ASSERT_OP_OK(cuda::LinearBackward(context(), d_x, d_w, d_dy, s.tokens, s.in, s.out, d_dx_add,
                                        cuda::Accumulate::kAdd, nullptr));
      ExpectClose("linear dx (accumulated), " + name, DownloadAct(d_dx_add, dx_cpu.size()),
                  dx_add_cpu, StoredTolerance(c.dx, c.weight));
    }
  }
}

TEST_F(CudaOpsGpuTest, Bf16ActivationsRopeMatchesTheCpuOnRoundedInputs) {
  struct Size {
    size_t batch, seq, heads, head_dim;
  };
  for (const Size s : {Size{2, 7, 3, 16}, Size{1, 33, 2, 128}, Size{1, 1, 1, 2}}) {
    const size_t n = s.batch * s.seq * s.heads * s.head_dim;
    const float theta = 10000.0f;
    const auto x = RoundedTo(RandomVector(n, 40), kBF16);
    std::vector<float> fwd_cpu = x, bwd_cpu = x;
    cpu::RopeForward(fwd_cpu.data(), s.batch, s.seq, s.heads, s.head_dim, theta);
    cpu::RopeBackward(bwd_cpu.data(), s.batch, s.seq, s.heads, s.head_dim, theta);
    const cuda::Act d_fwd = UploadAct(x, kBF16);
    const cuda::Act d_bwd = UploadAct(x, kBF16);
    ASSERT_OP_OK(cuda::RopeForward(context(), d_fwd, s.batch, s.seq, s.heads, s.head_dim, theta));
    ASSERT_OP_OK(cuda::RopeBackward(context(), d_bwd, s.batch, s.seq, s.heads, s.head_dim, theta));
    ExpectClose("rope forward (bf16)", DownloadAct(d_fwd, n), fwd_cpu, kBf16Tolerance);
    ExpectClose("rope backward (bf16)", DownloadAct(d_bwd, n), bwd_cpu, kBf16Tolerance);
  }
}

TEST_F(CudaOpsGpuTest, Bf16ActivationsSiluMulMatchesTheCpuOnRoundedInputs) {
  for (const size_t n : {size_t{1000}, size_t{1}, size_t{257}}) {
    const auto gate = RoundedTo(RandomVector(n, 60, 4.0f), kBF16);
    const auto up = RoundedTo(RandomVector(n, 61), kBF16);
    const auto dh = RoundedTo(RandomVector(n, 62), kBF16);
    std::vector<float> h_cpu(n), dgate_cpu(n), dup_cpu(n);
    cpu::SiluMulForward(gate.data(), up.data(), n, h_cpu.data());
    cpu::SiluMulBackward(gate.data(), up.data(), dh.data(), n, dgate_cpu.data(), dup_cpu.data());
    const cuda::Act d_gate = UploadAct(gate, kBF16);
    const cuda::Act d_up = UploadAct(up, kBF16);
    const cuda::Act d_h = AllocAct(n, kBF16);
    ASSERT_OP_OK(cuda::SiluMulForward(context(), d_gate, d_up, n, d_h));
    ExpectClose("silu_mul h (bf16)", DownloadAct(d_h, n), h_cpu, kBf16Tolerance);
    // dgate written over dh.
    const cuda::Act d_dh = UploadAct(dh, kBF16);
    const cuda::Act d_dup = AllocAct(n, kBF16);
    ASSERT_OP_OK(cuda::SiluMulBackward(context(), d_gate, d_up, d_dh, n, d_dh, d_dup));
    ExpectClose("silu_mul dgate (bf16, over dh)", DownloadAct(d_dh, n), dgate_cpu, kBf16Tolerance);
    ExpectClose("silu_mul dup (bf16)", DownloadAct(d_dup, n), dup_cpu, kBf16Tolerance);
  }
}

// One fp32 operation per element, rounded once: the CPU's result rounded to bf16, to the bit.
TEST_F(CudaOpsGpuTest, Bf16ActivationsResidualScaleAndBiasMatchTheCpuBitForBit) {
  for (const size_t n : {size_t{1000}, size_t{1}, size_t{1u << 20}}) {
    const auto a = RoundedTo(RandomVector(n, 70), kBF16);
    const auto b = RoundedTo(RandomVector(n, 71), kBF16);
    std::vector<float> y_cpu(n), acc_cpu = a, scaled_cpu = b;
    cpu::ResidualAdd(a.data(), b.data(), n, y_cpu.data());
    cpu::AccumulateGradient(b.data(), n, acc_cpu.data());
    cpu::Scale(scaled_cpu.data(), n, 0.37f);
    const cuda::Act d_a = UploadAct(a, kBF16);
    const cuda::Act d_b = UploadAct(b, kBF16);
    const cuda::Act d_y = AllocAct(n, kBF16);
    ASSERT_OP_OK(cuda::ResidualAdd(context(), d_a, d_b, n, d_y));
    ExpectBitEqual("residual y (bf16)", DownloadAct(d_y, n), RoundedTo(y_cpu, kBF16));
    ASSERT_OP_OK(cuda::AccumulateGradient(context(), d_b, n, d_a));
    ExpectBitEqual("accumulated gradient (bf16)", DownloadAct(d_a, n), RoundedTo(acc_cpu, kBF16));
    ASSERT_OP_OK(cuda::Scale(context(), d_b, n, 0.37f));
    ExpectBitEqual("scaled (bf16)", DownloadAct(d_b, n), RoundedTo(scaled_cpu, kBF16));
  }
  // Bias: y += bias in place; dbias (fp32) sums bf16 rows.
  const size_t rows = 33, cols = 70;
  const auto y = RoundedTo(RandomVector(rows * cols, 72), kBF16);
  const auto dy = RoundedTo(RandomVector(rows * cols, 73), kBF16);
  const auto db0 = RandomVector(cols, 74);
  for (const DType dtype : kDTypes) {
    const HostWeight bias = MakeWeight(RandomVector(cols, 75), dtype);
    std::vector<float> y_cpu = y;
    cpu::BiasForward(y_cpu.data(), bias.cpu(), rows, cols);
    const cuda::Act d_y = UploadAct(y, kBF16);
    ASSERT_OP_OK(cuda::BiasForward(context(), d_y, Upload(bias), rows, cols));
    ExpectBitEqual(Label("bias y (bf16)", dtype), DownloadAct(d_y, y.size()),
                   RoundedTo(y_cpu, kBF16));
  }
  std::vector<float> db_cpu = db0;
  cpu::BiasBackward(dy.data(), rows, cols, db_cpu.data());
  float* d_db = Upload(db0);
  ASSERT_OP_OK(cuda::BiasBackward(context(), UploadAct(dy, kBF16), rows, cols, d_db));
  ExpectClose("bias dbias (bf16 dy)", Download(d_db, cols), db_cpu, kF32Tolerance);
}

TEST_F(CudaOpsGpuTest, Bf16ActivationsCrossEntropyMatchesTheCpuOnRoundedLogits) {
  struct Size {
    size_t tokens, vocab;
  };
  for (const Size s : {Size{37, 1000}, Size{300, 33}, Size{1, 1}}) {
    const size_t n = s.tokens * s.vocab;
    const auto logits = RoundedTo(RandomVector(n, 80, 3.0f), kBF16);
    auto targets = RandomTokens(s.tokens, static_cast<int32_t>(s.vocab), 81);
    for (size_t t = 0; t < s.tokens; t += 5)
      targets[t] = cpu::kIgnoreIndex;
    if (s.tokens == 1) targets[0] = 0;
    const float dloss = 1.7f;
    std::vector<float> lse_cpu(s.tokens), dlogits_cpu(n);
    ASSERT_OK_AND_ASSIGN(const float loss_cpu,
                         cpu::CrossEntropyForward(logits.data(), targets.data(), s.tokens, s.vocab,
                                                  cpu::kIgnoreIndex, lse_cpu.data()));
    ASSERT_OK(cpu::CrossEntropyBackward(logits.data(), targets.data(), lse_cpu.data(), s.tokens,
                                        s.vocab, cpu::kIgnoreIndex, dloss, dlogits_cpu.data()));

    const cuda::Act d_logits = UploadAct(logits, kBF16);
    const int32_t* d_targets = Upload(targets);
    float* d_lse = Alloc<float>(s.tokens);
    float* d_loss = Alloc<float>(1);
    ASSERT_OP_OK(cuda::CrossEntropyForward(context(), d_logits, d_targets, s.tokens, s.vocab,
                                           cuda::kIgnoreIndex, d_lse, d_loss));
    ExpectClose("cross-entropy loss (bf16 logits)", Download(d_loss, 1), {loss_cpu}, kF32Tolerance);
    ExpectClose("cross-entropy lse (bf16 logits)", Download(d_lse, s.tokens), lse_cpu,
                kF32Tolerance);
    const cuda::Act d_dlogits = AllocAct(n, kBF16);
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), d_logits, d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, d_dlogits));
    ExpectClose("cross-entropy dlogits (bf16)", DownloadAct(d_dlogits, n), dlogits_cpu,
                kBf16Tolerance);
    // In place over the logits.
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), d_logits, d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, d_logits));
    ExpectClose("cross-entropy dlogits (bf16, in place)", DownloadAct(d_logits, n), dlogits_cpu,
                kBf16Tolerance);
    EXPECT_OK(cuda::CheckDataErrors(context()));
  }
}

// The vocabulary split's ops on bf16 activations (one rank's share; VocabularyShardOpsMatchTheCpu
// has the fp32 ones).
TEST_F(CudaOpsGpuTest, Bf16ActivationsVocabularyShardOpsMatchTheCpu) {
  const size_t T = 45, V = 36, H = 40, begin = 12, part = 12;
  const auto tokens = RandomTokens(T, static_cast<int32_t>(V), 101);
  auto targets = RandomTokens(T, static_cast<int32_t>(V), 102);
  for (size_t t = 0; t < T; t += 7)
    targets[t] = cpu::kIgnoreIndex;
  const auto logits = RoundedTo(RandomVector(T * part, 103, 3.0f), kBF16);
  const auto dout = RoundedTo(RandomVector(T * H, 104), kBF16);
  const float dloss = 0.9f;
  const int32_t* d_tokens = Upload(tokens);
  const int32_t* d_targets = Upload(targets);

  const HostWeight hw = MakeWeight(RandomVector(part * H, 105), kBF16);
  std::vector<float> out_cpu(T * H);
  cpu::ShardEmbeddingForward(tokens.data(), T, hw.cpu(), begin, part, H, out_cpu.data());
  const cuda::Act d_out = AllocAct(T * H, kBF16);
  ASSERT_OP_OK(
      cuda::ShardEmbeddingForward(context(), d_tokens, T, Upload(hw), begin, part, H, d_out));
  ExpectBitEqual("shard embedding out (bf16)", DownloadAct(d_out, T * H), out_cpu);
  const auto dw0 = RandomVector(part * H, 110);
  std::vector<float> dw_cpu = dw0;
  cpu::ShardEmbeddingBackward(tokens.data(), T, dout.data(), begin, part, H, dw_cpu.data(),
                              tokens[1]);
  float* d_dw = Upload(dw0);
  ASSERT_OP_OK(cuda::ShardEmbeddingBackward(context(), d_tokens, T, UploadAct(dout, kBF16), begin,
                                            part, H, d_dw, tokens[1]));
  ExpectBitEqual("shard embedding dweight (bf16 dout)", Download(d_dw, dw_cpu.size()), dw_cpu);

  std::vector<float> max_cpu(T), sums_cpu(2 * T), lse_cpu(T), dlogits_cpu(T * part);
  cpu::CrossEntropyShardMax(logits.data(), T, part, max_cpu.data());
  cpu::CrossEntropyShardSums(logits.data(), targets.data(), T, begin, part, cpu::kIgnoreIndex,
                             max_cpu.data(), sums_cpu.data());
  const float loss_cpu = cpu::CrossEntropyShardFinish(
      targets.data(), T, cpu::kIgnoreIndex, max_cpu.data(), sums_cpu.data(), lse_cpu.data());
  cpu::CrossEntropyShardBackward(logits.data(), targets.data(), lse_cpu.data(), T, begin, part,
                                 cpu::kIgnoreIndex, dloss, dlogits_cpu.data());
  const cuda::Act d_logits = UploadAct(logits, kBF16);
  float* d_max = Alloc<float>(T);
  float* d_sums = Alloc<float>(2 * T);
  float* d_lse = Alloc<float>(T);
  float* d_loss = Alloc<float>(1);
  ASSERT_OP_OK(cuda::CrossEntropyShardMax(context(), d_logits, T, part, d_max));
  ExpectBitEqual("shard cross-entropy max (bf16 logits)", Download(d_max, T), max_cpu);
  ASSERT_OP_OK(cuda::CrossEntropyShardSums(context(), d_logits, d_targets, T, begin, part,
                                           cuda::kIgnoreIndex, d_max, d_sums));
  ExpectClose("shard cross-entropy sums (bf16 logits)", Download(d_sums, 2 * T), sums_cpu,
              kF32Tolerance);
  ASSERT_OP_OK(cuda::CrossEntropyShardFinish(context(), d_targets, T, cuda::kIgnoreIndex, d_max,
                                             d_sums, d_lse, d_loss));
  ExpectClose("shard cross-entropy loss (bf16 logits)", Download(d_loss, 1), {loss_cpu},
              kF32Tolerance);
  ASSERT_OP_OK(cuda::CrossEntropyShardBackward(context(), d_logits, d_targets, d_lse, T, begin,
                                               part, cuda::kIgnoreIndex, dloss, d_logits));
  ExpectClose("shard cross-entropy dlogits (bf16, in place)", DownloadAct(d_logits, T * part),
              dlogits_cpu, kBf16Tolerance);
  EXPECT_OK(cuda::CheckDataErrors(context()));
}

// 16-bit activations of the attention's dtype on the tensor cores (Strata's kernels, not
// cuDNN's), head_dim 64 and 128, with the tiled kernels' tolerances plus the stored outputs'
// rounding; one case starts its inputs one element off the 16-byte alignment (scalar loads).
TEST_F(CudaOpsGpuTest, SixteenBitActivationsAttentionOnTensorCoresMatchesTheCpu) {
  const AttentionSwitch kernels("kernels");
  for (const DType dtype : {kBF16, DType::kF16}) {
    const double rounding = dtype == kBF16 ? 1.0 / 256 : 1.0 / 2048;
    const double out_tol = 1e-2 + rounding;
    const double grad_tol = (dtype == kBF16 ? 3e-2 : 1e-2) + rounding;
    for (const AttentionCase& c :
         {AttentionCase{1, 64, 2, 2, 64}, AttentionCase{2, 100, 4, 2, 64},
          AttentionCase{1, 130, 2, 1, 128}, AttentionCase{1, 3, 2, 1, 128}}) {
      ASSERT_STREQ(cuda::PrepareAttention(context(), c.batch, c.seq, c.heads, c.kv_heads,
                                          c.head_dim, cuda::ToCudaDType(dtype)),
                   "tensor cores");
      CheckAttention(c, dtype, dtype, out_tol, grad_tol, 80, 0, dtype);
      if (c.seq == 100) CheckAttention(c, dtype, dtype, out_tol, grad_tol, 81, 1, dtype);
    }
  }
}

// bf16 activations on the exact kernels (STRATA_ATTENTION=exact at head_dim 64 and 128; 72 takes
// them anyway): fp32 arithmetic on the stored inputs, so only the outputs' rounding remains.
TEST_F(CudaOpsGpuTest, Bf16ActivationsAttentionOnExactKernelsMatchesTheCpu) {
  for (const AttentionCase& c : {AttentionCase{1, 33, 4, 1, 64}, AttentionCase{2, 20, 2, 2, 128},
                                 AttentionCase{2, 20, 2, 2, 72}}) {
    std::unique_ptr<AttentionSwitch> exact;
    if (c.head_dim != 72) exact = std::make_unique<AttentionSwitch>("exact");
    ASSERT_STREQ(cuda::PrepareAttention(context(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                                        cuda::DType::kBF16),
                 "exact");
    CheckAttention(c, kBF16, kBF16, kBf16Tolerance, kBf16Tolerance, 90, 0, kBF16);
  }
}

// cuDNN's attention reading and writing bf16 activations in place (where a cuDNN 9 is found, as
// AttentionFromCudnnMatchesTheCpuOnRoundedInputs), with its tolerances: its outputs were bf16
// before as well. The misaligned case runs Strata's kernels (cuDNN needs 16-byte alignment).
TEST_F(CudaOpsGpuTest, Bf16ActivationsAttentionFromCudnnMatchesTheCpu) {
  const char* first = cuda::PrepareAttention(context(), 1, 64, 2, 2, 64, cuda::DType::kBF16);
  if (std::string(first) != "cudnn") {
    const Result<cudnn::Library>& lib = cudnn::ProcessLibrary();
    GTEST_SKIP() << "cuDNN's attention is not available here ("
                 << (lib.ok() ? "loaded, but the GPU or the shape is not supported; see the log"
                              : lib.status().ToString())
                 << ")";
  }
  for (const AttentionCase& c : {AttentionCase{1, 64, 2, 2, 64}, AttentionCase{2, 100, 4, 2, 64},
                                 AttentionCase{1, 130, 2, 1, 128}, AttentionCase{1, 512, 32, 4, 64},
                                 AttentionCase{1, 256, 32, 8, 128}}) {
    ASSERT_STREQ(cuda::PrepareAttention(context(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                                        cuda::DType::kBF16),
                 "cudnn")
        << c.Name();
    CheckAttention(c, kBF16, kBF16, 1e-2, 3e-2, 100, 0, kBF16);
    if (c.seq == 100) {
      CheckAttention(c, kBF16, kBF16, 1e-2 + 1.0 / 256, 3e-2 + 1.0 / 256, 101, 1, kBF16);
    }
  }
}

// Every activation of a call shares one dtype (a linear layer's excepted), and 16-bit attention
// activations have the attention's dtype: kArgument otherwise, before anything runs.
TEST_F(CudaOpsGpuTest, ActivationsOfMixedDTypesAreInvalidArgument) {
  const size_t n = 64;
  const cuda::Act f32 = UploadAct(std::vector<float>(n, 1.0f), DType::kF32);
  const cuda::Act b16 = UploadAct(std::vector<float>(n, 1.0f), kBF16);
  const cuda::Weight w = Upload(MakeWeight(std::vector<float>(n, 1.0f), kBF16));
  float* stats = Upload(std::vector<float>(n, 1.0f));
  const int32_t* targets = Upload(std::vector<int32_t>(n, 0));
  auto expect_mixed = [](const cuda::OpError& error, const char* what) {
    EXPECT_EQ(error.source, cuda::ErrorSource::kArgument) << what;
    EXPECT_EQ(cuda::ToStatus(error).code(), StatusCode::kInvalidArgument) << what;
    EXPECT_NE(std::string(error.what).find("mixed dtypes"), std::string::npos)
        << what << ": " << error.what;
  };
  expect_mixed(cuda::ResidualAdd(context(), b16, f32, n, b16), "ResidualAdd");
  expect_mixed(cuda::AccumulateGradient(context(), f32, n, b16), "AccumulateGradient");
  expect_mixed(cuda::RmsNormForward(context(), b16, w, 4, 16, 1e-5f, f32, stats), "RmsNormForward");
  expect_mixed(cuda::RmsNormBackward(context(), b16, w, stats, f32, 4, 16, b16, nullptr),
               "RmsNormBackward");
  expect_mixed(cuda::ResidualRmsNormForward(context(), b16, b16, w, 4, 16, 1e-5f, b16, f32, stats),
               "ResidualRmsNormForward");
  expect_mixed(cuda::SiluMulForward(context(), b16, f32, n, b16), "SiluMulForward");
  expect_mixed(cuda::SiluMulBackward(context(), b16, b16, b16, n, b16, f32), "SiluMulBackward");
  expect_mixed(cuda::CrossEntropyBackward(context(), b16, targets, stats, 4, 16, cuda::kIgnoreIndex,
                                          1.0f, f32),
               "CrossEntropyBackward");
  expect_mixed(cuda::AttentionForward(context(), b16, f32, b16, 1, 4, 1, 1, 16, b16, stats,
                                      cuda::DType::kBF16),
               "AttentionForward");
  // 16-bit activations of another dtype than the attention's precision.
  const cuda::OpError precision = cuda::AttentionForward(context(), b16, b16, b16, 1, 4, 1, 1, 16,
                                                         b16, stats, cuda::DType::kF16);
  EXPECT_EQ(precision.source, cuda::ErrorSource::kArgument);
  EXPECT_NE(std::string(precision.what).find("precision"), std::string::npos) << precision.what;
  // A linear layer's activations may differ.
  const cuda::Act dx = AllocAct(n, kBF16);
  EXPECT_OK(cuda::ToStatus(cuda::LinearForward(context(), b16, w, 4, 16, 4, f32)));
  EXPECT_OK(cuda::ToStatus(cuda::LinearBackward(context(), f32, w, b16, 4, 16, 4, dx,
                                                cuda::Accumulate::kOverwrite, nullptr)));
  EXPECT_OK(device_->Synchronize(*stream_));
}

// ---- without a GPU ------------------------------------------------------------------------------

TEST(CudaOpsTest, ErrorsBecomeStatusesNamingTheOpAndTheCall) {
  EXPECT_OK(cuda::ToStatus(cuda::OpError{}));
  const Status argument = cuda::ToStatus(
      cuda::OpError{cuda::ErrorSource::kArgument, 0, "head_dim must be even", "RopeForward"});
  EXPECT_EQ(argument.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(argument.ToString().find("RopeForward: head_dim must be even"), std::string::npos);
  // 2 is cudaErrorMemoryAllocation.
  const Status oom =
      cuda::ToStatus(cuda::OpError{cuda::ErrorSource::kCuda, 2, "cudaMalloc", "LinearForward"});
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(oom.ToString().find("LinearForward: cudaMalloc failed"), std::string::npos)
      << oom.ToString();
  EXPECT_NE(oom.ToString().find("cudaErrorMemoryAllocation"), std::string::npos) << oom.ToString();
  // 7 is CUBLAS_STATUS_INVALID_VALUE.
  const Status cublas = cuda::ToStatus(
      cuda::OpError{cuda::ErrorSource::kCublas, 7, "cublasGemmEx", "LinearBackward"});
  EXPECT_EQ(cublas.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(cublas.ToString().find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos)
      << cublas.ToString();
}

}  // namespace
}  // namespace strata::model
