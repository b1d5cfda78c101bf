// Token data: .npy and raw token files (round trips, every bad-input error naming the file), the
// sequence sampler's order contract (determinism, exact resume, rank disjointness, the same global
// batch on 1, 2 and 4 ranks), and the synthetic corpus (deterministic, in vocab, learnable).
#include "train/data.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "test_support.h"

namespace strata::train {
namespace {

using ::strata::testing::TempDir;
using ::testing::HasSubstr;

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string LittleEndian(const std::vector<uint32_t>& tokens, size_t item) {
  std::string out;
  for (uint32_t t : tokens) {
    for (size_t b = 0; b < item; ++b)
      out.push_back(static_cast<char>((t >> (8 * b)) & 0xff));
  }
  return out;
}

// A .npy file with a hand-written header dictionary (any version), padded as numpy pads.
std::string NpyBytes(int major, const std::string& dict, const std::string& data) {
  const size_t len_bytes = major == 1 ? 2 : 4;
  std::string header = dict;
  const size_t unpadded = 8 + len_bytes + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  for (size_t b = 0; b < len_bytes; ++b)
    out.push_back(static_cast<char>((header.size() >> (8 * b)) & 0xff));
  return out + header + data;
}

std::vector<uint32_t> Iota(size_t n, uint32_t modulo) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<uint32_t>(i % modulo);
  return v;
}

std::vector<int32_t> ReadAll(const TokenDataset& d) {
  std::vector<int32_t> out(d.size());
  Status s = d.Read(0, out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

std::vector<int32_t> AsInt(const std::vector<uint32_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

// ---- files -------------------------------------------------------------------------------------

class NpyRoundTripTest : public ::testing::TestWithParam<TokenDtype> {};

TEST_P(NpyRoundTripTest, WriterThenDataset) {
  TempDir dir;
  const std::string path = dir.file("tokens.npy");
  const std::vector<uint32_t> tokens = Iota(1000, 50000);
  {
    auto w = TokenFileWriter::Create(path, GetParam(), tokens.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE(w->Append(std::span(tokens).subspan(0, 300)).ok());
    ASSERT_TRUE(w->Append(std::span(tokens).subspan(300)).ok());
    ASSERT_TRUE(w->Commit().ok());
  }
  // Only the finished file is left: no temporary beside it.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1);
  auto d = TokenDataset::Open(path, 50000);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->is_npy());
  EXPECT_EQ(d->dtype(), GetParam());
  EXPECT_EQ(d->size(), tokens.size());
  EXPECT_EQ(d->data_offset() % 64, 0u);  // version 1.0 header padded to 64 bytes
  EXPECT_EQ(ReadAll(*d), AsInt(tokens));
  std::vector<int32_t> mid(7);
  ASSERT_TRUE(d->Read(993, mid).ok());
  EXPECT_EQ(mid, AsInt(std::vector<uint32_t>(tokens.begin() + 993, tokens.end())));
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, NpyRoundTripTest,
                         ::testing::Values(TokenDtype::kUint16, TokenDtype::kUint32,
                                           TokenDtype::kInt32),
                         [](const auto& param_info) {
                           return std::string(TokenDtypeName(param_info.param));
                         });

TEST(TokenFileTest, HandWrittenHeadersOfEveryVersion) {
  TempDir dir;
  const std::vector<uint32_t> tokens = {5, 0, 9, 3};
  const std::string data = LittleEndian(tokens, 4);
  int i = 0;
  for (const auto& [major, dict] : std::vector<std::pair<int, std::string>>{
           {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }"},
           {2, "{\"descr\": \"<u4\", \"fortran_order\": False, \"shape\": (4L,)}"},
           {3, "{'shape': (4,), 'fortran_order': True, 'descr': '<i4'}"}}) {
    const std::string path = dir.file(fmt::format("v{}.npy", i++));
    WriteBytes(path, NpyBytes(major, dict, data));
    auto d = TokenDataset::Open(path, 10);
    ASSERT_TRUE(d.ok()) << dict << ": " << d.status().ToString();
    EXPECT_EQ(ReadAll(*d), AsInt(tokens)) << dict;
  }
}

TEST(TokenFileTest, RawRoundTripEveryDtype) {
  TempDir dir;
  for (TokenDtype dtype : {TokenDtype::kUint16, TokenDtype::kUint32, TokenDtype::kInt32}) {
    const std::string path = dir.file(fmt::format("tokens-{}.bin", TokenDtypeName(dtype)));
    const std::vector<uint32_t> tokens = Iota(777, 60000);
    auto w = TokenFileWriter::Create(path, dtype, tokens.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE(w->Append(tokens).ok());
    ASSERT_TRUE(w->Commit().ok());
    EXPECT_EQ(std::filesystem::file_size(path), tokens.size() * TokenDtypeSize(dtype));
    auto d = TokenDataset::Open(path, 60000, dtype);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_FALSE(d->is_npy());
    EXPECT_EQ(ReadAll(*d), AsInt(tokens));
  }
}

TEST(TokenFileTest, WriterWithoutCommitLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  {
    auto w = TokenFileWriter::Create(path, TokenDtype::kUint16, 4);
    ASSERT_TRUE(w.ok());
    std::vector<uint32_t> too_big = {1, 70000};
    Status s = w->Append(too_big);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("70000"));
    EXPECT_EQ(w->Commit().code(), StatusCode::kFailedPrecondition);  // 0 of 4 written
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(TokenFileTest, WriterToMissingDirectoryNamesIt) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/t.npy");
  auto w = TokenFileWriter::Create(path, TokenDtype::kUint16, 4);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr(path));
}

struct BadFile {
  std::string name;
  std::string bytes;
  StatusCode code;
  std::string needle;
};

TEST(TokenFileTest, BadFilesNameTheFileAndTheProblem) {
  const std::string u2 = "{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }";
  const std::string four = LittleEndian({1, 2, 3, 4}, 2);
  const std::vector<BadFile> cases = {
      {"magic.npy", "NOTNUMPY" + std::string(100, ' '), StatusCode::kInvalidArgument, "magic"},
      {"tiny.npy", "\x93NUM", StatusCode::kInvalidArgument, "only 4 bytes"},
      {"version.npy", NpyBytes(4, u2, four), StatusCode::kInvalidArgument, "version 4.0"},
      {"dict.npy", NpyBytes(1, "{'descr': '<u2' 'shape': (4,)}", four),
       StatusCode::kInvalidArgument, "header dictionary"},
      {"nodescr.npy", NpyBytes(1, "{'fortran_order': False, 'shape': (4,)}", four),
       StatusCode::kInvalidArgument, "'descr'"},
      {"dtype.npy", NpyBytes(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", four),
       StatusCode::kInvalidArgument, "dtype '<f4' is not supported"},
      {"bigendian.npy",
       NpyBytes(1, "{'descr': '>u2', 'fortran_order': False, 'shape': (4,)}", four),
       StatusCode::kInvalidArgument, "'>u2'"},
      {"u1.npy", NpyBytes(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (8,)}", four),
       StatusCode::kInvalidArgument, "'|u1'"},
      {"2d.npy", NpyBytes(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 2)}", four),
       StatusCode::kInvalidArgument, "2-D (shape (2, 2))"},
      {"0d.npy", NpyBytes(1, "{'descr': '<u2', 'fortran_order': False, 'shape': ()}", four),
       StatusCode::kInvalidArgument, "0-D"},
      {"short.npy", NpyBytes(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (9,)}", four),
       StatusCode::kDataLoss, "truncated"},
      {"huge.npy",
       NpyBytes(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (99999999999999999,)}", four),
       StatusCode::kDataLoss, "99999999999999999 tokens"},
      {"trailing.npy", NpyBytes(1, u2, four + "xx"), StatusCode::kInvalidArgument,
       "unexpected bytes"},
      {"odd.bin", "abc", StatusCode::kInvalidArgument, "not a whole number of uint16 tokens"},
      {"empty.bin", "", StatusCode::kInvalidArgument, "no tokens"},
  };
  TempDir dir;
  for (const BadFile& c : cases) {
    const std::string path = dir.file(c.name);
    WriteBytes(path, c.bytes);
    auto d = TokenDataset::Open(path, 100);
    ASSERT_FALSE(d.ok()) << c.name;
    EXPECT_EQ(d.status().code(), c.code) << c.name << ": " << d.status().ToString();
    EXPECT_THAT(d.status().message(), HasSubstr(path)) << c.name;
    EXPECT_THAT(d.status().message(), HasSubstr(c.needle)) << c.name;
  }
  auto missing = TokenDataset::Open(dir.file("missing.bin"), 100);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir.file("missing.bin")));
  auto bad_vocab = TokenDataset::Open(dir.file("empty.bin"), 0);
  EXPECT_EQ(bad_vocab.status().code(), StatusCode::kInvalidArgument);
}

TEST(TokenFileTest, IdsOutsideVocabNamePositionAndValue) {
  TempDir dir;
  const std::string path = dir.file("t.npy");
  WriteBytes(path, NpyBytes(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (5,)}",
                            LittleEndian({1, 2, 3, 0xfffffffd, 4}, 4)));
  auto d = TokenDataset::Open(path, 4);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  std::vector<int32_t> two(2);
  EXPECT_TRUE(d->Read(0, two).ok());
  Status neg = d->Read(2, two);  // tokens 2 and 3: 3 is fine, -3 is not
  EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(neg.message(), HasSubstr(path));
  EXPECT_THAT(neg.message(), HasSubstr("position 3 is negative (-3)"));
  std::vector<int32_t> one(1);
  Status big = d->Read(4, one);
  EXPECT_THAT(big.message(), HasSubstr("position 4 is 4, not below the vocab size 4"));
  Status past = d->Read(4, two);
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(past.message(), HasSubstr(path));

  // The same file read as uint32: 0xfffffffd is simply too large.
  const std::string raw = dir.file("t.bin");
  WriteBytes(raw, LittleEndian({0xfffffffd}, 4));
  auto r = TokenDataset::Open(raw, 1000, TokenDtype::kUint32);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->Read(0, one).message(), HasSubstr("position 0 is 4294967293"));
}

// ---- sampler -----------------------------------------------------------------------------------

// A stream where token i is i (so a sequence tells where it came from).
class SamplerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("stream.bin");
    auto w = TokenFileWriter::Create(path_, TokenDtype::kUint32, kTokens);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(w->Append(Iota(kTokens, kTokens)).ok());
    ASSERT_TRUE(w->Commit().ok());
    auto d = TokenDataset::Open(path_, kTokens, TokenDtype::kUint32);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    data_ = std::make_unique<TokenDataset>(std::move(d).value());
  }

  SequenceSampler Make(uint64_t seq_len, uint64_t global_batch, SamplingMode mode,
                       uint64_t seed = 7) {
    auto s = SequenceSampler::Create(data_.get(), {seq_len, global_batch, mode, seed});
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return std::move(s).value();
  }

  static std::vector<int32_t> GlobalBatch(const SequenceSampler& s, uint64_t step) {
    std::vector<int32_t> out(s.global_batch() * s.tokens_per_sequence());
    Status st = s.ReadGlobalBatch(step, out);
    EXPECT_TRUE(st.ok()) << st.ToString();
    return out;
  }

  static constexpr uint64_t kTokens = 1001;  // 125 windows of 8+1 tokens, 62 of 16+1
  TempDir dir_;
  std::string path_;
  std::unique_ptr<TokenDataset> data_;
};

TEST_F(SamplerTest, SequencesAreWindowsWithShiftedTargets) {
  SequenceSampler s = Make(8, 4, SamplingMode::kSequential);
  EXPECT_EQ(s.num_windows(), 125u);
  EXPECT_EQ(s.steps_per_epoch(), 31u);
  std::vector<int32_t> batch = GlobalBatch(s, 1);
  ASSERT_EQ(batch.size(), 4u * 9u);
  for (int b = 0; b < 4; ++b) {
    for (int t = 0; t < 9; ++t)
      EXPECT_EQ(batch[b * 9 + t], (4 + b) * 8 + t);
  }
  // Step 31 starts epoch 1 (the last window of epoch 0 does not fill a step and is skipped).
  auto start = s.StartOf(31);
  ASSERT_TRUE(start.ok());
  EXPECT_EQ(start->epoch, 1u);
  EXPECT_EQ(start->position, 0u);
  EXPECT_EQ(GlobalBatch(s, 31), GlobalBatch(s, 0));
}

TEST_F(SamplerTest, RandomOrderIsAPermutationPerEpochAndSeeded) {
  SequenceSampler s = Make(8, 5, SamplingMode::kRandom, 11);
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<uint64_t> seen;
    for (uint64_t p = 0; p < s.num_windows(); ++p)
      seen.insert(s.SampleWindow(epoch, p));
    EXPECT_EQ(seen.size(), s.num_windows());
    EXPECT_EQ(*seen.rbegin(), s.num_windows() - 1);
  }
  std::vector<uint64_t> e0, e1;
  for (uint64_t p = 0; p < 20; ++p) {
    e0.push_back(s.SampleWindow(0, p));
    e1.push_back(s.SampleWindow(1, p));
  }
  EXPECT_NE(e0, e1);
  SequenceSampler other_seed = Make(8, 5, SamplingMode::kRandom, 12);
  EXPECT_NE(*s.GlobalBatchWindows(3), *other_seed.GlobalBatchWindows(3));
  // Edge sizes of the permutation domain.
  for (uint64_t n : {1, 2, 3, 4, 5, 17, 64, 65}) {
    std::set<uint64_t> seen;
    for (uint64_t p = 0; p < n; ++p)
      seen.insert(PermuteWindow(3, 0, n, p));
    EXPECT_EQ(seen.size(), n);
    EXPECT_LT(*seen.rbegin(), n);
  }
}

TEST_F(SamplerTest, SameSeedAndStepGiveSameDataWhateverCameBefore) {
  SequenceSampler a = Make(8, 6, SamplingMode::kRandom);
  SequenceSampler b = Make(8, 6, SamplingMode::kRandom);
  // `a` reads steps in order, `b` jumps straight to step 40 (epoch 2) and back.
  std::vector<std::vector<int32_t>> in_order;
  for (uint64_t step = 0; step <= 40; ++step)
    in_order.push_back(GlobalBatch(a, step));
  EXPECT_EQ(GlobalBatch(b, 40), in_order[40]);
  EXPECT_EQ(GlobalBatch(b, 3), in_order[3]);
  EXPECT_EQ(GlobalBatch(a, 17), in_order[17]);
}

TEST_F(SamplerTest, ResumeFromSavedStateEqualsUninterrupted) {
  for (SamplingMode mode : {SamplingMode::kSequential, SamplingMode::kRandom}) {
    SequenceSampler run = Make(8, 6, mode);
    std::vector<std::vector<int32_t>> uninterrupted;
    for (int i = 0; i < 50; ++i) {
      uninterrupted.push_back(GlobalBatch(run, run.step()));
      run.Advance();
    }
    SequenceSampler first = Make(8, 6, mode);
    for (int i = 0; i < 23; ++i)
      first.Advance();
    const SamplerState saved = first.state();
    EXPECT_EQ(saved.step, 23u);
    EXPECT_EQ(saved.epoch, 1u);  // 20 steps of 6 per epoch of 125 windows
    EXPECT_EQ(saved.position, 18u);

    SequenceSampler resumed = Make(8, 6, mode);
    ASSERT_TRUE(resumed.Restore(saved).ok());
    EXPECT_EQ(resumed.state(), saved);
    for (int i = 23; i < 50; ++i) {
      EXPECT_EQ(GlobalBatch(resumed, resumed.step()), uninterrupted[i]) << "step " << i;
      resumed.Advance();
    }
    // Steps before the restore point are not known to the restored sampler.
    EXPECT_EQ(resumed.StartOf(22).status().code(), StatusCode::kOutOfRange);
  }
}

TEST_F(SamplerTest, RestoreRefusesADifferentOrder) {
  SequenceSampler s = Make(8, 4, SamplingMode::kRandom, 7);
  SamplerState state = s.state();
  SequenceSampler other_seed = Make(8, 4, SamplingMode::kRandom, 8);
  Status st = other_seed.Restore(state);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("seed 7 (now 8)"));
  SequenceSampler other_len = Make(16, 4, SamplingMode::kRandom, 7);
  EXPECT_THAT(other_len.Restore(state).message(), HasSubstr("seq_len 8 (now 16)"));
  SequenceSampler sequential = Make(8, 4, SamplingMode::kSequential, 7);
  EXPECT_THAT(sequential.Restore(state).message(), HasSubstr("sampling random"));
  state.num_windows = 99;
  EXPECT_THAT(s.Restore(state).message(), HasSubstr("99 sequences"));
}

TEST_F(SamplerTest, RestoreWithANewGlobalBatchContinuesTheEpoch) {
  SequenceSampler s = Make(8, 4, SamplingMode::kRandom);
  for (int i = 0; i < 5; ++i)
    s.Advance();
  const SamplerState saved = s.state();  // epoch 0, position 20
  SequenceSampler bigger = Make(8, 8, SamplingMode::kRandom);
  ASSERT_TRUE(bigger.Restore(saved).ok());
  auto windows = bigger.GlobalBatchWindows(5);
  ASSERT_TRUE(windows.ok());
  for (uint64_t b = 0; b < 8; ++b)
    EXPECT_EQ((*windows)[b], bigger.SampleWindow(0, 20 + b));
  bigger.Advance();
  EXPECT_EQ(bigger.state().position, 28u);
}

TEST_F(SamplerTest, RanksAreDisjointAndEveryWorldSizeSeesTheSameGlobalBatch) {
  constexpr uint64_t kGlobal = 8;
  constexpr uint64_t kRow = 9;
  const std::vector<BatchLayout> layouts = {{1, 2, 4}, {1, 8, 1}, {2, 2, 2},
                                            {2, 4, 1}, {4, 1, 2}, {4, 2, 1}};
  for (SamplingMode mode : {SamplingMode::kSequential, SamplingMode::kRandom}) {
    SequenceSampler s = Make(8, kGlobal, mode);
    for (uint64_t step : {0, 1, 15, 16, 33}) {
      const std::vector<int32_t> reference = GlobalBatch(s, step);
      for (const BatchLayout& layout : layouts) {
        ASSERT_EQ(layout.global_batch(), kGlobal);
        std::vector<int32_t> assembled(kGlobal * kRow, -1);
        std::set<int32_t> first_tokens;
        for (int rank = 0; rank < layout.world_size; ++rank) {
          for (int a = 0; a < layout.grad_accum; ++a) {
            std::vector<int32_t> mine(layout.micro_batch * kRow);
            Status st = s.ReadRankBatch(step, layout, rank, a, mine);
            ASSERT_TRUE(st.ok()) << st.ToString();
            for (int i = 0; i < layout.micro_batch; ++i) {
              const uint64_t b = GlobalBatchIndex(layout, rank, a, i);
              std::copy_n(mine.begin() + i * kRow, kRow, assembled.begin() + b * kRow);
              EXPECT_TRUE(first_tokens.insert(mine[i * kRow]).second)
                  << "a window used twice in step " << step;
            }
          }
        }
        EXPECT_EQ(assembled, reference) << "world " << layout.world_size << " step " << step;
      }
    }
  }
}

TEST_F(SamplerTest, BadArgumentsAreErrors) {
  auto too_big = SequenceSampler::Create(data_.get(), {8, 126, SamplingMode::kRandom, 0});
  EXPECT_EQ(too_big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(), HasSubstr(path_));
  EXPECT_THAT(too_big.status().message(), HasSubstr("125 sequences"));
  EXPECT_FALSE(SequenceSampler::Create(data_.get(), {0, 1, SamplingMode::kRandom, 0}).ok());
  SequenceSampler s = Make(8, 4, SamplingMode::kRandom);
  std::vector<int32_t> out(9);
  EXPECT_THAT(s.ReadRankBatch(0, {2, 1, 1}, 0, 0, out).message(), HasSubstr("global batch is 4"));
  EXPECT_FALSE(s.ReadRankBatch(0, {2, 1, 2}, 2, 0, out).ok());
  EXPECT_FALSE(s.ReadGlobalBatch(0, out).ok());
}

// ---- synthetic corpus --------------------------------------------------------------------------

std::vector<int32_t> Synthesize(const TempDir& dir, const std::string& name, SynthOptions o) {
  const std::string path = dir.file(name);
  Status s = WriteSyntheticCorpus(path, o);
  EXPECT_TRUE(s.ok()) << s.ToString();
  auto d = TokenDataset::Open(path, o.vocab, o.dtype);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  return d.ok() ? ReadAll(*d) : std::vector<int32_t>{};
}

TEST(SyntheticCorpusTest, DeterministicForASeedAndWithinVocab) {
  TempDir dir;
  SynthOptions o{.tokens = 50000, .vocab = 300, .seed = 5, .dtype = TokenDtype::kUint16};
  const std::vector<int32_t> a = Synthesize(dir, "a.bin", o);
  const std::vector<int32_t> b = Synthesize(dir, "b.npy", o);  // Open checks every id < vocab
  ASSERT_EQ(a.size(), 50000u);
  EXPECT_EQ(a, b);
  o.seed = 6;
  EXPECT_NE(Synthesize(dir, "c.bin", o), a);
  o.dtype = TokenDtype::kUint32;
  o.vocab = 100000;
  const std::vector<int32_t> wide = Synthesize(dir, "d.npy", o);
  EXPECT_GT(*std::max_element(wide.begin(), wide.end()), 65535);
  // Chunked generation equals one pass.
  SyntheticTokenGenerator g1(300, 5), g2(300, 5);
  std::vector<uint32_t> whole(1000), parts(1000);
  g1.Generate(whole);
  g2.Generate(std::span(parts).subspan(0, 1));
  g2.Generate(std::span(parts).subspan(1, 400));
  g2.Generate(std::span(parts).subspan(401));
  EXPECT_EQ(whole, parts);
  EXPECT_EQ(AsInt(whole), std::vector<int32_t>(a.begin(), a.begin() + 1000));
}

TEST(SyntheticCorpusTest, BadOptionsAreErrors) {
  TempDir dir;
  EXPECT_THAT(WriteSyntheticCorpus(dir.file("x.bin"), {.tokens = 10, .vocab = 70000}).message(),
              HasSubstr("uint16"));
  EXPECT_FALSE(WriteSyntheticCorpus(dir.file("x.bin"), {.tokens = 0, .vocab = 10}).ok());
  EXPECT_FALSE(WriteSyntheticCorpus(dir.file("x.bin"), {.tokens = 10, .vocab = 0}).ok());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// Learnable in the simplest sense: the next token given the current one is far more predictable
// than a uniform guess (empirical conditional entropy well below ln(vocab)).
TEST(SyntheticCorpusTest, BigramEntropyIsFarBelowUniform) {
  TempDir dir;
  constexpr uint64_t kVocab = 512;
  const std::vector<int32_t> t = Synthesize(
      dir, "c.bin", {.tokens = 400000, .vocab = kVocab, .seed = 1, .dtype = TokenDtype::kUint16});
  std::map<std::pair<int32_t, int32_t>, uint64_t> bigrams;
  std::vector<uint64_t> unigrams(kVocab);
  for (size_t i = 0; i + 1 < t.size(); ++i) {
    ++bigrams[{t[i], t[i + 1]}];
    ++unigrams[t[i]];
  }
  const double n = static_cast<double>(t.size() - 1);
  double conditional = 0, marginal = 0;
  for (const auto& [pair, c] : bigrams)
    conditional -= c / n * std::log(static_cast<double>(c) / unigrams[pair.first]);
  for (uint64_t c : unigrams) {
    if (c > 0) marginal -= c / n * std::log(c / n);
  }
  const double uniform = std::log(static_cast<double>(kVocab));
  // Theory: about 0.95 * 1.2 + 0.2 + 0.05 * ln(512) = 1.65 nats, against ln(512) = 6.24.
  EXPECT_LT(conditional, 2.0) << "marginal " << marginal;
  EXPECT_LT(conditional, uniform / 3);
  EXPECT_GT(marginal, conditional + 3);  // the context, not just token frequencies, carries it
}

}  // namespace
}  // namespace strata::train
