// Tests of the Llama CPU kernels (src/model/cpu_ops.h):
//   - Oracle tests: Strata's forward and backward against tests/oracle/llama_ops_ref.py, which
//     recomputes each op with torch autograd in float64 (run with Debian's /usr/bin/python3; the
//     tests skip when it or torch is missing). Tolerances are per op, |a - ref| <= atol +
//     rtol|ref|.
//   - Finite-difference tests: each backward against central differences of
//     L = sum(out * upstream) on tiny sizes, independent of Python.
//   - Weight dtype tests: bf16 / fp16 weights give bit-for-bit the result of fp32 weights holding
//     the rounded values.
#include "model/cpu_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "test_support.h"

namespace strata::model::cpu {
namespace {

using device::DType;

constexpr const char* kPython = "/usr/bin/python3";

using strata::testing::RandomTokens;
using strata::testing::RandomVector;

Weight F32(const std::vector<float>& w) {
  return Weight{w.data(), DType::kF32};
}

// Why the oracle cannot run, or "" when it can (checked once per process).
const std::string& OracleUnavailableReason() {
  static const std::string reason = [] {
    if (!std::filesystem::exists(kPython)) return std::string(kPython) + " does not exist";
    const std::string command = std::string(kPython) + " -c 'import torch, numpy' > /dev/null 2>&1";
    if (std::system(command.c_str()) != 0) {
      return std::string(kPython) + " cannot import torch and numpy";
    }
    return std::string();
  }();
  return reason;
}

// One oracle run: the inputs written to a temp dir, the script run, its outputs read back.
class OracleCase {
 public:
  explicit OracleCase(std::string op) : op_(std::move(op)) {
    meta_["op"] = op_;
    meta_["params"] = nlohmann::json::object();
    meta_["tensors"] = nlohmann::json::object();
  }

  void Param(const std::string& name, nlohmann::json value) { meta_["params"][name] = value; }

  void Tensor(const std::string& name, const std::vector<float>& data, std::vector<size_t> shape) {
    Write(name, data.data(), data.size() * sizeof(float), "f32", std::move(shape));
  }
  void Tensor(const std::string& name, const std::vector<int32_t>& data,
              std::vector<size_t> shape) {
    Write(name, data.data(), data.size() * sizeof(int32_t), "i32", std::move(shape));
  }

  // Runs the script; false (with a gtest failure) when it fails.
  bool Run() {
    std::ofstream(dir_.file("meta.json")) << meta_.dump();
    const std::string script = (testing::SourceDir() / "tests/oracle/llama_ops_ref.py").string();
    const std::string command =
        std::string(kPython) + " " + script + " " + dir_.path().string() + " " + op_;
    const int rc = std::system(command.c_str());
    EXPECT_EQ(rc, 0) << command;
    return rc == 0;
  }

  std::vector<double> Ref(const std::string& name) const {
    const std::vector<char> bytes = testing::ReadWholeFile(dir_.file("ref_" + name + ".bin"));
    std::vector<double> out(bytes.size() / sizeof(double));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(double));
    return out;
  }

 private:
  void Write(const std::string& name, const void* data, size_t bytes, const char* dtype,
             std::vector<size_t> shape) {
    std::ofstream f(dir_.file(name + ".bin"), std::ios::binary);
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    meta_["tensors"][name] = {{"shape", shape}, {"dtype", dtype}};
  }

  std::string op_;
  testing::TempDir dir_;
  nlohmann::json meta_;
};

// Expects |actual - ref| <= atol + rtol |ref| elementwise; prints the measured worst errors.
void ExpectClose(const std::string& what, const std::vector<float>& actual,
                 const std::vector<double>& ref, double atol, double rtol) {
  ASSERT_EQ(actual.size(), ref.size()) << what;
  double max_abs = 0.0, max_rel = 0.0, worst_ratio = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(actual[i]) - ref[i]);
    max_abs = std::max(max_abs, err);
    if (std::abs(ref[i]) > 1e-3) max_rel = std::max(max_rel, err / std::abs(ref[i]));
    const double ratio = err / (atol + rtol * std::abs(ref[i]) + 1e-300);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  std::printf("  %-26s max abs err %.3g, max rel err (|ref|>1e-3) %.3g  [atol %.1g rtol %.1g]\n",
              what.c_str(), max_abs, max_rel, atol, rtol);
  EXPECT_LE(worst_ratio, 1.0) << what << ": element " << worst << " is " << actual[worst]
                              << ", reference " << ref[worst];
}

#define STRATA_SKIP_WITHOUT_ORACLE()                                               \
  do {                                                                             \
    if (!OracleUnavailableReason().empty())                                        \
      GTEST_SKIP() << "PyTorch oracle unavailable: " << OracleUnavailableReason(); \
  } while (false)

// ---- Oracle tests
// ---------------------------------------------------------------------------------

TEST(CpuOpsOracleTest, Embedding) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t T = 13, V = 11, H = 24;  // T > V: tokens repeat, so the scatter-add is exercised
  const auto tokens = RandomTokens(T, V, 1);
  const auto weight = RandomVector(V * H, 2);
  const auto dy = RandomVector(T * H, 3);
  std::vector<float> y(T * H), dweight(V * H, 0.0f);
  ASSERT_TRUE(EmbeddingForward(tokens.data(), T, F32(weight), V, H, y.data()).ok());
  ASSERT_TRUE(EmbeddingBackward(tokens.data(), T, dy.data(), V, H, dweight.data()).ok());

  OracleCase oracle("embedding");
  oracle.Tensor("tokens", tokens, {T});
  oracle.Tensor("weight", weight, {V, H});
  oracle.Tensor("dy", dy, {T, H});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("embedding y", y, oracle.Ref("y"), 0.0, 0.0);
  ExpectClose("embedding dweight", dweight, oracle.Ref("dweight"), 1e-6, 1e-6);
}

// nn.Embedding's padding_idx: the pad token's lookups add nothing to its row; every other row is
// what it is without the skip.
TEST(CpuOpsTest, EmbeddingBackwardSkipsThePadToken) {
  const size_t T = 13, V = 11, H = 8;
  const auto tokens = RandomTokens(T, V, 1);
  const auto dy = RandomVector(T * H, 3);
  const int32_t pad = tokens[2];
  std::vector<float> all(V * H, 0.5f), skipped(V * H, 0.5f);
  ASSERT_TRUE(EmbeddingBackward(tokens.data(), T, dy.data(), V, H, all.data()).ok());
  ASSERT_TRUE(EmbeddingBackward(tokens.data(), T, dy.data(), V, H, skipped.data(), pad).ok());
  for (size_t v = 0; v < V; ++v) {
    for (size_t i = 0; i < H; ++i) {
      if (static_cast<int32_t>(v) == pad) {
        EXPECT_EQ(skipped[v * H + i], 0.5f);
        EXPECT_NE(all[v * H + i], 0.5f);
      } else {
        EXPECT_EQ(skipped[v * H + i], all[v * H + i]);
      }
    }
  }
}

TEST(CpuOpsOracleTest, RmsNorm) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t T = 14, H = 67;
  const float eps = 1e-5f;
  const auto x = RandomVector(T * H, 4);
  auto weight = RandomVector(H, 5, 0.2f);
  for (float& w : weight)
    w += 1.0f;
  const auto dy = RandomVector(T * H, 6);
  std::vector<float> y(T * H), rstd(T), dx(T * H), dweight(H, 0.0f);
  RmsNormForward(x.data(), F32(weight), T, H, eps, y.data(), rstd.data());
  RmsNormBackward(x.data(), F32(weight), rstd.data(), dy.data(), T, H, dx.data(), dweight.data());

  OracleCase oracle("rmsnorm");
  oracle.Param("eps", eps);
  oracle.Tensor("x", x, {T, H});
  oracle.Tensor("weight", weight, {H});
  oracle.Tensor("dy", dy, {T, H});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("rmsnorm y", y, oracle.Ref("y"), 1e-6, 1e-5);
  ExpectClose("rmsnorm dx", dx, oracle.Ref("dx"), 1e-5, 1e-4);
  ExpectClose("rmsnorm dweight", dweight, oracle.Ref("dweight"), 1e-5, 1e-5);
}

TEST(CpuOpsOracleTest, Linear) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t T = 15, in = 37, out = 29;
  const auto x = RandomVector(T * in, 7);
  const auto weight = RandomVector(out * in, 8, 0.2f);
  const auto dy = RandomVector(T * out, 9);
  std::vector<float> y(T * out), dx(T * in), dweight(out * in, 0.0f);
  LinearForward(x.data(), F32(weight), T, in, out, y.data());
  LinearBackward(x.data(), F32(weight), dy.data(), T, in, out, dx.data(), Accumulate::kOverwrite,
                 dweight.data());

  OracleCase oracle("linear");
  oracle.Tensor("x", x, {T, in});
  oracle.Tensor("weight", weight, {out, in});
  oracle.Tensor("dy", dy, {T, out});
  ASSERT_TRUE(oracle.Run());
  // A sum of K fp32 products: error grows like sqrt(K) ulps of the terms' magnitude.
  ExpectClose("linear y", y, oracle.Ref("y"), 1e-5, 1e-4);
  ExpectClose("linear dx", dx, oracle.Ref("dx"), 1e-5, 1e-4);
  ExpectClose("linear dweight", dweight, oracle.Ref("dweight"), 1e-5, 1e-4);
}

TEST(CpuOpsOracleTest, Rope) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t batch = 2, seq = 37, heads = 3, d = 16;
  const float theta = 10000.0f;
  const auto x = RandomVector(batch * seq * heads * d, 10);
  const auto dy = RandomVector(x.size(), 11);
  std::vector<float> y = x, dx = dy;
  RopeForward(y.data(), batch, seq, heads, d, theta);
  RopeBackward(dx.data(), batch, seq, heads, d, theta);

  OracleCase oracle("rope");
  oracle.Param("batch", batch);
  oracle.Param("seq", seq);
  oracle.Param("heads", heads);
  oracle.Param("head_dim", d);
  oracle.Param("theta", theta);
  oracle.Tensor("x", x, {batch * seq, heads * d});
  oracle.Tensor("dy", dy, {batch * seq, heads * d});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("rope y", y, oracle.Ref("y"), 1e-6, 1e-5);
  ExpectClose("rope dx", dx, oracle.Ref("dx"), 1e-6, 1e-5);
}

struct AttentionShape {
  size_t batch, seq, heads, kv_heads, head_dim;
};

void RunAttentionOracle(const AttentionShape& s, uint64_t seed) {
  const size_t T = s.batch * s.seq;
  const size_t qw = s.heads * s.head_dim, kvw = s.kv_heads * s.head_dim;
  const auto q = RandomVector(T * qw, seed);
  const auto k = RandomVector(T * kvw, seed + 1);
  const auto v = RandomVector(T * kvw, seed + 2);
  const auto dy = RandomVector(T * qw, seed + 3);
  std::vector<float> y(T * qw), lse(s.batch * s.heads * s.seq), dq(T * qw), dk(T * kvw),
      dv(T * kvw);
  AttentionForward(q.data(), k.data(), v.data(), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim,
                   y.data(), lse.data());
  AttentionBackward(q.data(), k.data(), v.data(), y.data(), lse.data(), dy.data(), s.batch, s.seq,
                    s.heads, s.kv_heads, s.head_dim, dq.data(), dk.data(), dv.data());

  OracleCase oracle("attention");
  oracle.Param("batch", s.batch);
  oracle.Param("seq", s.seq);
  oracle.Param("num_heads", s.heads);
  oracle.Param("num_kv_heads", s.kv_heads);
  oracle.Param("head_dim", s.head_dim);
  oracle.Tensor("q", q, {T, qw});
  oracle.Tensor("k", k, {T, kvw});
  oracle.Tensor("v", v, {T, kvw});
  oracle.Tensor("dy", dy, {T, qw});
  ASSERT_TRUE(oracle.Run());
  const std::string tag =
      "attention nh" + std::to_string(s.heads) + "/nkv" + std::to_string(s.kv_heads) + " ";
  ExpectClose(tag + "y", y, oracle.Ref("y"), 2e-5, 1e-4);
  ExpectClose(tag + "dq", dq, oracle.Ref("dq"), 2e-5, 1e-4);
  ExpectClose(tag + "dk", dk, oracle.Ref("dk"), 2e-5, 1e-4);
  ExpectClose(tag + "dv", dv, oracle.Ref("dv"), 2e-5, 1e-4);
}

TEST(CpuOpsOracleTest, AttentionGroupedQuery) {
  STRATA_SKIP_WITHOUT_ORACLE();
  RunAttentionOracle({2, 19, 4, 2, 16}, 20);
}

TEST(CpuOpsOracleTest, AttentionMultiHeadAndMultiQuery) {
  STRATA_SKIP_WITHOUT_ORACLE();
  RunAttentionOracle({1, 23, 3, 3, 8}, 30);  // nkv == nh: plain multi-head
  RunAttentionOracle({3, 7, 4, 1, 12}, 40);  // nkv == 1: multi-query
  RunAttentionOracle({1, 1, 2, 1, 4}, 50);   // one token
}

TEST(CpuOpsOracleTest, SiluMul) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t T = 9, I = 53;
  const auto gate = RandomVector(T * I, 60, 3.0f);
  const auto up = RandomVector(T * I, 61);
  const auto dy = RandomVector(T * I, 62);
  std::vector<float> y(T * I), dgate(T * I), dup(T * I);
  SiluMulForward(gate.data(), up.data(), y.size(), y.data());
  SiluMulBackward(gate.data(), up.data(), dy.data(), y.size(), dgate.data(), dup.data());

  OracleCase oracle("silu_mul");
  oracle.Tensor("gate", gate, {T, I});
  oracle.Tensor("up", up, {T, I});
  oracle.Tensor("dy", dy, {T, I});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("silu_mul y", y, oracle.Ref("y"), 1e-7, 1e-6);
  ExpectClose("silu_mul dgate", dgate, oracle.Ref("dgate"), 1e-7, 1e-6);
  ExpectClose("silu_mul dup", dup, oracle.Ref("dup"), 1e-7, 1e-6);
}

TEST(CpuOpsOracleTest, Residual) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t n = 101;
  const auto a = RandomVector(n, 70);
  const auto b = RandomVector(n, 71);
  const auto dy = RandomVector(n, 72);
  std::vector<float> y(n), da(n, 0.0f), db(n, 0.0f);
  ResidualAdd(a.data(), b.data(), n, y.data());
  AccumulateGradient(dy.data(), n, da.data());
  AccumulateGradient(dy.data(), n, db.data());

  OracleCase oracle("residual");
  oracle.Tensor("a", a, {n});
  oracle.Tensor("b", b, {n});
  oracle.Tensor("dy", dy, {n});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("residual y", y, oracle.Ref("y"), 0.0, 1e-7);
  ExpectClose("residual da", da, oracle.Ref("da"), 0.0, 0.0);
  ExpectClose("residual db", db, oracle.Ref("db"), 0.0, 0.0);
}

TEST(CpuOpsOracleTest, CrossEntropyWithIgnoredTargets) {
  STRATA_SKIP_WITHOUT_ORACLE();
  const size_t T = 12, V = 257;
  const auto logits = RandomVector(T * V, 80, 4.0f);
  auto targets = RandomTokens(T, V, 81);
  targets[2] = kIgnoreIndex;
  targets[7] = kIgnoreIndex;
  const float dloss = 1.7f;
  std::vector<float> lse(T);
  Result<float> loss =
      CrossEntropyForward(logits.data(), targets.data(), T, V, kIgnoreIndex, lse.data());
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  std::vector<float> dlogits(T * V);
  ASSERT_TRUE(CrossEntropyBackward(logits.data(), targets.data(), lse.data(), T, V, kIgnoreIndex,
                                   dloss, dlogits.data())
                  .ok());

  OracleCase oracle("cross_entropy");
  oracle.Param("ignore_index", kIgnoreIndex);
  oracle.Tensor("logits", logits, {T, V});
  oracle.Tensor("targets", targets, {T});
  oracle.Tensor("dy", std::vector<float>{dloss}, {1});
  ASSERT_TRUE(oracle.Run());
  ExpectClose("cross_entropy loss", {*loss}, oracle.Ref("y"), 0.0, 1e-6);
  ExpectClose("cross_entropy dlogits", dlogits, oracle.Ref("dlogits"), 1e-8, 1e-5);
}

// ---- Finite differences -------------------------------------------------------------------------

// Checks `analytic` = dL/dparam for L = sum_i forward()_i * upstream_i against central
// differences, perturbing `param` (which forward() reads) in place. fp32 forward noise divided by
// 2 * step sets the tolerance: about 1e-7 * |L| / step.
void ExpectMatchesFiniteDifferences(const std::string& what, std::vector<float>& param,
                                    const std::vector<float>& analytic,
                                    const std::function<std::vector<float>()>& forward,
                                    const std::vector<float>& upstream, float step = 1e-2f,
                                    double atol = 3e-3, double rtol = 1e-2) {
  ASSERT_EQ(param.size(), analytic.size()) << what;
  auto loss = [&] {
    const std::vector<float> out = forward();
    double sum = 0.0;
    for (size_t i = 0; i < out.size(); ++i)
      sum += static_cast<double>(out[i]) * upstream[i];
    return sum;
  };
  double worst = 0.0;
  for (size_t i = 0; i < param.size(); ++i) {
    const float saved = param[i];
    param[i] = saved + step;
    const double plus = loss();
    param[i] = saved - step;
    const double minus = loss();
    param[i] = saved;
    const double numeric = (plus - minus) / (2.0 * step);
    const double err = std::abs(numeric - analytic[i]);
    worst = std::max(worst, err);
    EXPECT_LE(err, atol + rtol * std::abs(numeric))
        << what << "[" << i << "]: analytic " << analytic[i] << ", numeric " << numeric;
  }
  std::printf("  %-26s max |analytic - numeric| %.3g\n", what.c_str(), worst);
}

TEST(CpuOpsGradTest, RmsNorm) {
  const size_t T = 3, H = 7;
  auto x = RandomVector(T * H, 100);
  auto w = RandomVector(H, 101, 0.3f);
  for (float& v : w)
    v += 1.0f;
  const auto dy = RandomVector(T * H, 102);
  std::vector<float> y(T * H), rstd(T), dx(T * H), dw(H, 0.0f);
  RmsNormForward(x.data(), F32(w), T, H, 1e-5f, y.data(), rstd.data());
  RmsNormBackward(x.data(), F32(w), rstd.data(), dy.data(), T, H, dx.data(), dw.data());
  auto forward = [&] {
    std::vector<float> out(T * H), r(T);
    RmsNormForward(x.data(), F32(w), T, H, 1e-5f, out.data(), r.data());
    return out;
  };
  ExpectMatchesFiniteDifferences("rmsnorm dx", x, dx, forward, dy);
  ExpectMatchesFiniteDifferences("rmsnorm dweight", w, dw, forward, dy);
}

TEST(CpuOpsGradTest, LinearAccumulates) {
  const size_t T = 4, in = 5, out = 3;
  auto x = RandomVector(T * in, 110);
  auto w = RandomVector(out * in, 111);
  const auto dy = RandomVector(T * out, 112);
  // dx with kAdd on top of a prior value, dweight on top of a prior value: both accumulate.
  std::vector<float> dx(T * in, 0.5f), dw(out * in, -0.25f);
  LinearBackward(x.data(), F32(w), dy.data(), T, in, out, dx.data(), Accumulate::kAdd, dw.data());
  for (float& v : dx)
    v -= 0.5f;
  for (float& v : dw)
    v += 0.25f;
  auto forward = [&] {
    std::vector<float> y(T * out);
    LinearForward(x.data(), F32(w), T, in, out, y.data());
    return y;
  };
  ExpectMatchesFiniteDifferences("linear dx", x, dx, forward, dy);
  ExpectMatchesFiniteDifferences("linear dweight", w, dw, forward, dy);
}

TEST(CpuOpsGradTest, Rope) {
  const size_t batch = 2, seq = 5, heads = 2, d = 6;
  auto x = RandomVector(batch * seq * heads * d, 120);
  const auto dy = RandomVector(x.size(), 121);
  std::vector<float> dx = dy;
  RopeBackward(dx.data(), batch, seq, heads, d, 500000.0f);
  auto forward = [&] {
    std::vector<float> y = x;
    RopeForward(y.data(), batch, seq, heads, d, 500000.0f);
    return y;
  };
  ExpectMatchesFiniteDifferences("rope dx", x, dx, forward, dy);
}

TEST(CpuOpsGradTest, Attention) {
  const size_t batch = 2, seq = 4, nh = 4, nkv = 2, d = 3;
  const size_t T = batch * seq;
  auto q = RandomVector(T * nh * d, 130);
  auto k = RandomVector(T * nkv * d, 131);
  auto v = RandomVector(T * nkv * d, 132);
  const auto dy = RandomVector(T * nh * d, 133);
  std::vector<float> y(T * nh * d), lse(batch * nh * seq), dq(q.size()), dk(k.size()), dv(v.size());
  AttentionForward(q.data(), k.data(), v.data(), batch, seq, nh, nkv, d, y.data(), lse.data());
  AttentionBackward(q.data(), k.data(), v.data(), y.data(), lse.data(), dy.data(), batch, seq, nh,
                    nkv, d, dq.data(), dk.data(), dv.data());
  auto forward = [&] {
    std::vector<float> out(T * nh * d), l(batch * nh * seq);
    AttentionForward(q.data(), k.data(), v.data(), batch, seq, nh, nkv, d, out.data(), l.data());
    return out;
  };
  ExpectMatchesFiniteDifferences("attention dq", q, dq, forward, dy);
  ExpectMatchesFiniteDifferences("attention dk", k, dk, forward, dy);
  ExpectMatchesFiniteDifferences("attention dv", v, dv, forward, dy);
}

TEST(CpuOpsGradTest, SiluMul) {
  const size_t n = 17;
  auto gate = RandomVector(n, 140, 2.0f);
  auto up = RandomVector(n, 141);
  const auto dy = RandomVector(n, 142);
  std::vector<float> dgate(n), dup(n);
  SiluMulBackward(gate.data(), up.data(), dy.data(), n, dgate.data(), dup.data());
  auto forward = [&] {
    std::vector<float> h(n);
    SiluMulForward(gate.data(), up.data(), n, h.data());
    return h;
  };
  ExpectMatchesFiniteDifferences("silu_mul dgate", gate, dgate, forward, dy);
  ExpectMatchesFiniteDifferences("silu_mul dup", up, dup, forward, dy);
}

TEST(CpuOpsGradTest, Embedding) {
  const size_t T = 6, V = 4, H = 3;
  const std::vector<int32_t> tokens = {1, 3, 1, 0, 1, 3};
  auto w = RandomVector(V * H, 150);
  const auto dy = RandomVector(T * H, 151);
  std::vector<float> dw(V * H, 0.0f);
  ASSERT_TRUE(EmbeddingBackward(tokens.data(), T, dy.data(), V, H, dw.data()).ok());
  auto forward = [&] {
    std::vector<float> out(T * H);
    EXPECT_TRUE(EmbeddingForward(tokens.data(), T, F32(w), V, H, out.data()).ok());
    return out;
  };
  ExpectMatchesFiniteDifferences("embedding dweight", w, dw, forward, dy);
  // Token 2 never occurs: its row gets no gradient.
  for (size_t i = 0; i < H; ++i)
    EXPECT_EQ(dw[2 * H + i], 0.0f);
}

TEST(CpuOpsGradTest, CrossEntropyInPlace) {
  const size_t T = 5, V = 7;
  auto logits = RandomVector(T * V, 160, 2.0f);
  const std::vector<int32_t> targets = {3, kIgnoreIndex, 0, 6, 3};
  std::vector<float> lse(T);
  ASSERT_TRUE(
      CrossEntropyForward(logits.data(), targets.data(), T, V, kIgnoreIndex, lse.data()).ok());
  std::vector<float> dlogits = logits;  // in place: dlogits aliases the logits it reads
  ASSERT_TRUE(CrossEntropyBackward(dlogits.data(), targets.data(), lse.data(), T, V, kIgnoreIndex,
                                   1.0f, dlogits.data())
                  .ok());
  for (size_t j = 0; j < V; ++j)
    EXPECT_EQ(dlogits[1 * V + j], 0.0f);  // the ignored row
  auto forward = [&] {
    Result<float> loss =
        CrossEntropyForward(logits.data(), targets.data(), T, V, kIgnoreIndex, nullptr);
    EXPECT_TRUE(loss.ok());
    return std::vector<float>{loss.value_or(0.0f)};
  };
  ExpectMatchesFiniteDifferences("cross_entropy dlogits", logits, dlogits, forward, {1.0f});
}

// ---- Edge cases and errors ----------------------------------------------------------------------

TEST(CpuOpsTest, CrossEntropyAllIgnoredGivesZero) {
  const size_t T = 3, V = 5;
  const auto logits = RandomVector(T * V, 170);
  const std::vector<int32_t> targets(T, kIgnoreIndex);
  std::vector<float> lse(T), dlogits(T * V, 1.0f);
  Result<float> loss =
      CrossEntropyForward(logits.data(), targets.data(), T, V, kIgnoreIndex, lse.data());
  ASSERT_TRUE(loss.ok());
  EXPECT_EQ(*loss, 0.0f);
  ASSERT_TRUE(CrossEntropyBackward(logits.data(), targets.data(), lse.data(), T, V, kIgnoreIndex,
                                   1.0f, dlogits.data())
                  .ok());
  for (float g : dlogits)
    EXPECT_EQ(g, 0.0f);
}

TEST(CpuOpsTest, OutOfRangeIdsAreInvalidArgument) {
  const size_t V = 4, H = 2;
  const auto w = RandomVector(V * H, 180);
  std::vector<float> out(2 * H), dw(V * H, 0.0f);
  const std::vector<int32_t> bad = {1, 4};
  EXPECT_EQ(EmbeddingForward(bad.data(), 2, F32(w), V, H, out.data()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(EmbeddingBackward(bad.data(), 2, out.data(), V, H, dw.data()).code(),
            StatusCode::kInvalidArgument);
  const std::vector<int32_t> negative = {-1, 0};
  EXPECT_EQ(EmbeddingForward(negative.data(), 2, F32(w), V, H, out.data()).code(),
            StatusCode::kInvalidArgument);
  const std::vector<float> logits(2 * V, 0.0f);
  EXPECT_EQ(
      CrossEntropyForward(logits.data(), bad.data(), 2, V, kIgnoreIndex, nullptr).status().code(),
      StatusCode::kInvalidArgument);
  // -100 is only special as the ignore index; with another ignore index it is out of range.
  const std::vector<int32_t> minus100 = {kIgnoreIndex, 0};
  EXPECT_FALSE(CrossEntropyForward(logits.data(), minus100.data(), 2, V, -1, nullptr).ok());
}

// ---- Weight dtypes ------------------------------------------------------------------------------

class CpuOpsWeightDTypeTest : public ::testing::TestWithParam<DType> {
 protected:
  // The weights rounded to the parameter's dtype: the 16-bit storage and its fp32 values.
  void Round(const std::vector<float>& w, std::vector<uint16_t>& stored,
             std::vector<float>& as_f32) {
    stored.resize(w.size());
    as_f32.resize(w.size());
    for (size_t i = 0; i < w.size(); ++i) {
      if (GetParam() == DType::kBF16) {
        stored[i] = device::FloatToBf16(w[i]);
        as_f32[i] = device::Bf16ToFloat(stored[i]);
      } else {
        stored[i] = device::FloatToF16(w[i]);
        as_f32[i] = device::F16ToFloat(stored[i]);
      }
    }
  }
};

TEST_P(CpuOpsWeightDTypeTest, SameResultAsRoundedFp32Weights) {
  const size_t T = 6, in = 19, out = 11, V = 9;
  const auto x = RandomVector(T * in, 190);
  const auto dy = RandomVector(T * out, 191);
  std::vector<uint16_t> w16;
  std::vector<float> w32;
  Round(RandomVector(out * in, 192, 0.3f), w16, w32);
  const Weight half{w16.data(), GetParam()};

  // Linear.
  std::vector<float> y_a(T * out), y_b(T * out);
  LinearForward(x.data(), half, T, in, out, y_a.data());
  LinearForward(x.data(), F32(w32), T, in, out, y_b.data());
  EXPECT_EQ(y_a, y_b);
  std::vector<float> dx_a(T * in), dx_b(T * in), dw_a(out * in, 0.0f), dw_b(out * in, 0.0f);
  LinearBackward(x.data(), half, dy.data(), T, in, out, dx_a.data(), Accumulate::kOverwrite,
                 dw_a.data());
  LinearBackward(x.data(), F32(w32), dy.data(), T, in, out, dx_b.data(), Accumulate::kOverwrite,
                 dw_b.data());
  EXPECT_EQ(dx_a, dx_b);
  EXPECT_EQ(dw_a, dw_b);

  // RMSNorm (weight [in]).
  std::vector<uint16_t> n16;
  std::vector<float> n32;
  Round(RandomVector(in, 193), n16, n32);
  const Weight norm_half{n16.data(), GetParam()};
  std::vector<float> r_a(T), r_b(T), ny_a(T * in), ny_b(T * in);
  RmsNormForward(x.data(), norm_half, T, in, 1e-6f, ny_a.data(), r_a.data());
  RmsNormForward(x.data(), F32(n32), T, in, 1e-6f, ny_b.data(), r_b.data());
  EXPECT_EQ(ny_a, ny_b);
  std::vector<float> ndx_a(T * in), ndx_b(T * in), ndw_a(in, 0.0f), ndw_b(in, 0.0f);
  RmsNormBackward(x.data(), norm_half, r_a.data(), ny_a.data(), T, in, ndx_a.data(), ndw_a.data());
  RmsNormBackward(x.data(), F32(n32), r_b.data(), ny_b.data(), T, in, ndx_b.data(), ndw_b.data());
  EXPECT_EQ(ndx_a, ndx_b);
  EXPECT_EQ(ndw_a, ndw_b);

  // Embedding (table [V, in]).
  std::vector<uint16_t> e16;
  std::vector<float> e32;
  Round(RandomVector(V * in, 194), e16, e32);
  const auto tokens = RandomTokens(T, V, 195);
  std::vector<float> e_a(T * in), e_b(T * in);
  ASSERT_TRUE(EmbeddingForward(tokens.data(), T, {e16.data(), GetParam()}, V, in, e_a.data()).ok());
  ASSERT_TRUE(EmbeddingForward(tokens.data(), T, F32(e32), V, in, e_b.data()).ok());
  EXPECT_EQ(e_a, e_b);
}

INSTANTIATE_TEST_SUITE_P(HalfWeights, CpuOpsWeightDTypeTest,
                         ::testing::Values(DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& param_info) {
                           return std::string(device::DTypeName(param_info.param));
                         });

}  // namespace
}  // namespace strata::model::cpu
