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
  void CheckAttention(const AttentionCase& c, DType precision, DType cpu_rounding,
                      double out_tol, double grad_tol, uint32_t seed, size_t misalign = 0);

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
                                          s.hidden, d_out));
      ExpectBitEqual(Label("embedding out", dtype), Download(d_out, out_cpu.size()), out_cpu);
    }
    std::vector<float> dw_cpu = dw0;
    ASSERT_OK(cpu::EmbeddingBackward(tokens.data(), s.tokens, dout.data(), s.vocab, s.hidden,
                                     dw_cpu.data()));
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_tokens, s.tokens, Upload(dout), s.vocab,
                                         s.hidden, d_dw));
    ExpectBitEqual("embedding dweight (accumulated)", Download(d_dw, dw_cpu.size()), dw_cpu);
    // With a padding token (pad_token_id), whose lookups add nothing.
    std::vector<float> dw_pad_cpu = dw0;
    ASSERT_OK(cpu::EmbeddingBackward(tokens.data(), s.tokens, dout.data(), s.vocab, s.hidden,
                                     dw_pad_cpu.data(), tokens[0]));
    float* d_dw_pad = Upload(dw0);
    ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_tokens, s.tokens, Upload(dout), s.vocab,
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
  ASSERT_OP_OK(cuda::EmbeddingForward(context(), d_bad, bad.size(), cuda::Weight{w}, V, H, out));
  Status status = cuda::CheckDataErrors(context());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.ToString().find("token id 4 at position 2 is outside [0, 4)"), std::string::npos)
      << status.ToString();
  EXPECT_OK(cuda::CheckDataErrors(context()));  // the record was cleared

  float* dw = Alloc<float>(V * H);
  ASSERT_OP_OK(cuda::EmbeddingBackward(context(), d_bad, bad.size(), out, V, H, dw));
  EXPECT_EQ(cuda::CheckDataErrors(context()).code(), StatusCode::kInvalidArgument);

  const std::vector<int32_t> targets = {cuda::kIgnoreIndex, -1};
  const int32_t* d_targets = Upload(targets);
  const float* logits = Upload(RandomVector(2 * V, 11));
  float* loss = Alloc<float>(1);
  ASSERT_OP_OK(cuda::CrossEntropyForward(context(), logits, d_targets, 2, V, cuda::kIgnoreIndex,
                                         nullptr, loss));
  status = cuda::CheckDataErrors(context());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.ToString().find("target -1 at position 1"), std::string::npos)
      << status.ToString();
  float* lse = Alloc<float>(2);
  float* dlogits = Alloc<float>(2 * V);
  ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), logits, d_targets, lse, 2, V,
                                          cuda::kIgnoreIndex, 1.0f, dlogits));
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
      ASSERT_OP_OK(cuda::RmsNormForward(context(), d_x, d_w, s.tokens, s.hidden, eps, d_y, d_rstd));
      ExpectClose(Label("rmsnorm y", dtype), Download(d_y, n), y_cpu, kF32Tolerance);
      ExpectClose(Label("rmsnorm rstd", dtype), Download(d_rstd, s.tokens), rstd_cpu,
                  kF32Tolerance);
      // In place: dx overwrites dy (the weight gradient must read dy first).
      float* d_dy = Upload(dy);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(
          cuda::RmsNormBackward(context(), d_x, d_w, d_rstd, d_dy, s.tokens, s.hidden, d_dy, d_dw));
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
      ASSERT_OP_OK(cuda::LinearForward(context(), d_x, d_w, s.tokens, s.in, s.out, d_y));
      ExpectClose(Label("linear y", dtype), Download(d_y, y_cpu.size()), y_cpu, tol);

      // dx overwritten, dweight accumulated.
      std::vector<float> dx_cpu(s.tokens * s.in), dw_cpu = dw0;
      cpu::LinearBackward(x.data(), hw.cpu(), dy.data(), s.tokens, s.in, s.out, dx_cpu.data(),
                          cpu::Accumulate::kOverwrite, dw_cpu.data());
      float* d_dx = Upload(dx0);
      float* d_dw = Upload(dw0);
      ASSERT_OP_OK(cuda::LinearBackward(context(), d_x, d_w, d_dy, s.tokens, s.in, s.out, d_dx,
                                        cuda::Accumulate::kOverwrite, d_dw));
      ExpectClose(Label("linear dx", dtype), Download(d_dx, dx_cpu.size()), dx_cpu, tol);
      ExpectClose(Label("linear dweight (accumulated)", dtype), Download(d_dw, dw_cpu.size()),
                  dw_cpu, tol);

      // dx accumulated, no weight gradient.
      std::vector<float> dx_add_cpu = dx0;
      cpu::LinearBackward(x.data(), hw.cpu(), dy.data(), s.tokens, s.in, s.out, dx_add_cpu.data(),
                          cpu::Accumulate::kAdd, nullptr);
      float* d_dx_add = Upload(dx0);
      ASSERT_OP_OK(cuda::LinearBackward(context(), d_x, d_w, d_dy, s.tokens, s.in, s.out, d_dx_add,
                                        cuda::Accumulate::kAdd, nullptr));
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
    ASSERT_OP_OK(cuda::RopeForward(context(), d_fwd, s.batch, s.seq, s.heads, s.head_dim, theta));
    ASSERT_OP_OK(cuda::RopeBackward(context(), d_bwd, s.batch, s.seq, s.heads, s.head_dim, theta));
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

// x rounded to `dtype` and back (the identity for fp32).
std::vector<float> RoundedTo(const std::vector<float>& x, DType dtype) {
  if (dtype == DType::kF32) return x;
  std::vector<uint8_t> bytes(x.size() * device::DTypeSize(dtype));
  std::vector<float> back(x.size());
  device::ConvertHost(x.data(), DType::kF32, bytes.data(), dtype, x.size());
  device::ConvertHost(bytes.data(), dtype, back.data(), DType::kF32, x.size());
  return back;
}

// Attention forward and backward of `c` on the GPU in `precision` against the CPU, whose q, k, v
// and dout are first rounded to `cpu_rounding` (what the GPU kernels see): the output and lse
// within out_tol, the gradients within grad_tol. dq, dk and dv start as garbage (they are
// overwritten), and a second run gives the same bits.
void CudaOpsGpuTest::CheckAttention(const AttentionCase& c, DType precision, DType cpu_rounding,
                                    double out_tol, double grad_tol, uint32_t seed,
                                    size_t misalign) {
  const std::string shape = Label(c.Name(), precision);
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
  cpu::AttentionBackward(rq.data(), rk.data(), rv.data(), out_cpu.data(), lse_cpu.data(),
                         rdout.data(), c.batch, c.seq, c.heads, c.kv_heads, c.head_dim,
                         dq_cpu.data(), dk_cpu.data(), dv_cpu.data());

  const cuda::DType p = cuda::ToCudaDType(precision);
  // misalign > 0: the inputs start that many floats into their buffers (off the 16-byte
  // alignment the tiled kernels' vector loads need; they must fall back to scalar loads).
  auto upload_at = [&](const std::vector<float>& x) {
    std::vector<float> padded(misalign, 0.0f);
    padded.insert(padded.end(), x.begin(), x.end());
    return Upload(padded) + misalign;
  };
  const float* d_q = upload_at(q);
  const float* d_k = upload_at(k);
  const float* d_v = upload_at(v);
  const float* d_dout = upload_at(dout);
  float* d_out = Alloc<float>(q_n);
  float* d_lse = Alloc<float>(lse_n);
  float* d_dq = Upload(RandomVector(q_n, seed + 4));
  float* d_dk = Upload(RandomVector(kv_n, seed + 5));
  float* d_dv = Upload(RandomVector(kv_n, seed + 6));
  auto forward = [&] {
    return cuda::AttentionForward(context(), d_q, d_k, d_v, c.batch, c.seq, c.heads, c.kv_heads,
                                  c.head_dim, d_out, d_lse, p);
  };
  auto backward = [&] {
    return cuda::AttentionBackward(context(), d_q, d_k, d_v, d_out, d_lse, d_dout, c.batch, c.seq,
                                   c.heads, c.kv_heads, c.head_dim, d_dq, d_dk, d_dv, p);
  };
  ASSERT_OP_OK(forward());
  const std::vector<float> out_gpu = Download(d_out, q_n);
  ExpectClose("attention out " + shape, out_gpu, out_cpu, out_tol);
  ExpectClose("attention lse " + shape, Download(d_lse, lse_n), lse_cpu, out_tol);
  ASSERT_OP_OK(backward());
  const std::vector<float> dq_gpu = Download(d_dq, q_n);
  const std::vector<float> dk_gpu = Download(d_dk, kv_n);
  const std::vector<float> dv_gpu = Download(d_dv, kv_n);
  ExpectClose("attention dq " + shape, dq_gpu, dq_cpu, grad_tol);
  ExpectClose("attention dk " + shape, dk_gpu, dk_cpu, grad_tol);
  ExpectClose("attention dv " + shape, dv_gpu, dv_cpu, grad_tol);

  ASSERT_OP_OK(forward());
  ExpectBitEqual("attention out rerun " + shape, Download(d_out, q_n), out_gpu);
  ASSERT_OP_OK(backward());
  ExpectBitEqual("attention dq rerun " + shape, Download(d_dq, q_n), dq_gpu);
  ExpectBitEqual("attention dk rerun " + shape, Download(d_dk, kv_n), dk_gpu);
  ExpectBitEqual("attention dv rerun " + shape, Download(d_dv, kv_n), dv_gpu);
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
  EXPECT_EQ(cuda::ToStatus(cuda::AttentionForward(context(), buffer, buffer, buffer, 1, 1, 1, 1,
                                                  cuda::kMaxAttentionHeadDim + 2, buffer, buffer))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::ToStatus(cuda::AttentionForward(context(), buffer, buffer, buffer, 1, 1, 3, 2, 8,
                                                  buffer, buffer))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::ToStatus(cuda::RopeForward(context(), buffer, 1, 1, 1, 3, 10000.0f)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda::ToStatus(cuda::LinearForward(context(), buffer,
                                               cuda::Weight{buffer, static_cast<cuda::DType>(7)}, 1,
                                               1, 1, buffer))
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
    ASSERT_OP_OK(cuda::SiluMulForward(context(), d_gate, d_up, n, d_h));
    ExpectClose("silu_mul h", Download(d_h, n), h_cpu, kF32Tolerance);
    // dgate written over dh, as the contract allows.
    float* d_dh = Upload(dh);
    float* d_dup = Alloc<float>(n);
    ASSERT_OP_OK(cuda::SiluMulBackward(context(), d_gate, d_up, d_dh, n, d_dh, d_dup));
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
    ASSERT_OP_OK(cuda::ResidualAdd(context(), d_a, d_b, n, d_y));
    ExpectBitEqual("residual y", Download(d_y, n), y_cpu);
    ASSERT_OP_OK(cuda::AccumulateGradient(context(), d_b, n, d_a));
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
    ASSERT_OP_OK(cuda::CrossEntropyForward(context(), d_logits, d_targets, s.tokens, s.vocab,
                                           cuda::kIgnoreIndex, d_lse, d_loss));
    ExpectClose("cross-entropy loss", Download(d_loss, 1), {loss_cpu}, kF32Tolerance);
    ExpectClose("cross-entropy lse", Download(d_lse, s.tokens), lse_cpu, kF32Tolerance);
    float* d_dlogits = Alloc<float>(n);
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), d_logits, d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, d_dlogits));
    ExpectClose("cross-entropy dlogits", Download(d_dlogits, n), dlogits_cpu, kF32Tolerance);
    // In place over the logits.
    ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), d_logits, d_targets, d_lse, s.tokens,
                                            s.vocab, cuda::kIgnoreIndex, dloss, d_logits));
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
  ASSERT_OP_OK(
      cuda::CrossEntropyForward(context(), logits, targets, T, V, cuda::kIgnoreIndex, lse, loss));
  ASSERT_OP_OK(cuda::CrossEntropyBackward(context(), logits, targets, lse, T, V, cuda::kIgnoreIndex,
                                          1.0f, dlogits));
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
      ASSERT_OP_OK(
          cuda::ShardEmbeddingForward(context(), d_tokens, T, Upload(hw), begin, part, H, d_out));
      ExpectBitEqual(Label("shard embedding out" + rank, dtype), Download(d_out, T * H), out_cpu);
    }
    const auto dw0 = RandomVector(part * H, 110 + r);
    std::vector<float> dw_cpu = dw0;
    cpu::ShardEmbeddingBackward(tokens.data(), T, dout.data(), begin, part, H, dw_cpu.data(),
                                tokens[1]);
    float* d_dw = Upload(dw0);
    ASSERT_OP_OK(cuda::ShardEmbeddingBackward(context(), d_tokens, T, Upload(dout), begin, part, H,
                                              d_dw, tokens[1]));
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
    ASSERT_OP_OK(cuda::CrossEntropyShardMax(context(), d_logits, T, part, d_max));
    ExpectBitEqual("shard cross-entropy max" + rank, Download(d_max, T), max_cpu);
    ASSERT_OP_OK(cuda::CrossEntropyShardSums(context(), d_logits, d_targets, T, begin, part,
                                             cuda::kIgnoreIndex, d_max, d_sums));
    ExpectClose("shard cross-entropy sums" + rank, Download(d_sums, 2 * T), sums_cpu,
                kF32Tolerance);
    ASSERT_OP_OK(cuda::CrossEntropyShardFinish(context(), d_targets, T, cuda::kIgnoreIndex, d_max,
                                               d_sums, d_lse, d_loss));
    ExpectClose("shard cross-entropy loss" + rank, Download(d_loss, 1), {loss_cpu}, kF32Tolerance);
    ExpectClose("shard cross-entropy lse" + rank, Download(d_lse, T), lse_cpu, kF32Tolerance);
    ASSERT_OP_OK(cuda::CrossEntropyShardBackward(context(), d_logits, d_targets, d_lse, T, begin,
                                                 part, cuda::kIgnoreIndex, dloss, d_logits));
    ExpectClose("shard cross-entropy dlogits (in place)" + rank, Download(d_logits, T * part),
                dlogits_cpu, kF32Tolerance);
  }
  EXPECT_OK(cuda::CheckDataErrors(context()));
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
