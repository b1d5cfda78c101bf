// Prepared token data and packing: the container round-trips and refuses damaged files by name;
// documents pack whole in file order; each input's target, position and key start are what the
// documents alone would give; a long document's pieces train each of its targets exactly once;
// TrainedTargets agrees with what ReadPackedRow trains; loss weights make the step's loss the
// mean over the global batch's trained tokens; the sampler orders rows it does not read.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "test_support.h"
#include "train/data.h"
#include "train/packing.h"
#include "train/prepared_data.h"
#include "train/training_data.h"

namespace strata::train {
namespace {

using ::strata::testing::TempDir;
using ::testing::HasSubstr;

// Document d of length lens[d]: ids 1000 d + i, every token trained except `untrained` of them
// at the start (a prompt).
PreparedDocuments Documents(const std::vector<uint32_t>& lens, uint32_t untrained = 0) {
  PreparedDocuments in;
  for (size_t d = 0; d < lens.size(); ++d) {
    std::vector<uint32_t> ids(lens[d]);
    std::vector<uint8_t> mask(lens[d], 1);
    for (uint32_t i = 0; i < lens[d]; ++i) {
      ids[i] = static_cast<uint32_t>(1000 * d + i);
      if (i < untrained) mask[i] = 0;
    }
    in.documents.push_back(ids);
    in.masks.push_back(mask);
  }
  in.eos_token_id = 7;
  return in;
}

PreparedTokens Open(const std::string& path) {
  auto p = PreparedTokens::Open(path);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

struct Row {
  std::vector<int32_t> tokens, targets, positions, key_start;
  uint64_t trained = 0;
};

Row ReadRow(const PreparedTokens& data, const PackingPlan& plan, const PackingOptions& o,
            uint64_t r) {
  Row row;
  row.tokens.resize(o.seq_len + 1);
  row.targets.resize(o.seq_len);
  row.positions.resize(o.seq_len);
  row.key_start.resize(o.seq_len);
  auto n = ReadPackedRow(data, plan, o, r,
                         {row.tokens, row.targets, row.positions, row.key_start});
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  row.trained = n.ok() ? *n : 0;
  return row;
}

TEST(PreparedDataTest, RoundTripsDocumentsAndMasks) {
  TempDir dir;
  const std::string path = (dir.path() / "d.stk").string();
  PreparedDocuments in = Documents({5, 3, 9}, 2);
  in.tokenizer_hash = "0123456789abcdef";
  in.pad_token_id = 4;
  ASSERT_TRUE(WritePreparedData(path, in).ok());
  EXPECT_TRUE(IsPreparedData(path));
  const PreparedTokens p = Open(path);
  EXPECT_EQ(p.documents(), 3u);
  EXPECT_EQ(p.tokens(), 17u);
  EXPECT_EQ(p.trained_tokens(), 17u - 6u);
  EXPECT_EQ(p.tokenizer_hash(), "0123456789abcdef");
  EXPECT_EQ(p.eos_token_id(), 7);
  EXPECT_EQ(p.pad_token_id(), 4);
  EXPECT_EQ(p.doc_begin(1), 5u);
  EXPECT_EQ(p.doc_end(1), 8u);
  std::vector<int32_t> ids(9);
  std::vector<uint8_t> mask(9);
  ASSERT_TRUE(p.Read(8, ids, mask).ok());
  for (uint32_t i = 0; i < 9; ++i) {
    EXPECT_EQ(ids[i], static_cast<int32_t>(2000 + i));
    EXPECT_EQ(mask[i], i < 2 ? 0 : 1);
  }
  EXPECT_EQ(p.Read(10, ids, mask).code(), StatusCode::kOutOfRange);
  // A token stream is not prepared data.
  const std::string stream = (dir.path() / "t.bin").string();
  std::ofstream(stream, std::ios::binary) << std::string(64, '\1');
  EXPECT_FALSE(IsPreparedData(stream));
}

TEST(PreparedDataTest, DamagedFilesAreErrorsNamingTheFile) {
  TempDir dir;
  const std::string good = (dir.path() / "good.stk").string();
  ASSERT_TRUE(WritePreparedData(good, Documents({4, 4})).ok());
  std::string bytes;
  {
    std::ifstream f(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(f), {});
  }
  const auto expect_bad = [&](const std::string& name, std::string content, const char* what) {
    const std::string path = (dir.path() / name).string();
    std::ofstream(path, std::ios::binary | std::ios::trunc) << content;
    auto p = PreparedTokens::Open(path);
    ASSERT_FALSE(p.ok()) << name;
    EXPECT_THAT(p.status().message(), HasSubstr(path)) << name;
    EXPECT_THAT(p.status().message(), HasSubstr(what)) << name;
  };
  expect_bad("short.stk", bytes.substr(0, 10), "bytes");
  std::string v2 = bytes;
  v2[8] = 2;
  expect_bad("v2.stk", v2, "version 2");
  expect_bad("truncated.stk", bytes.substr(0, bytes.size() - 8), "section does not fit");
  // Document offsets that decrease: the second offset (4) becomes 9.
  std::string offsets = bytes;
  const size_t at = offsets.size() - 3 * 8 + 8;
  offsets[at] = 9;
  expect_bad("offsets.stk", offsets, "offsets decrease");
  // Ids at or above the model's vocabulary.
  auto small = PreparedTokens::Open(good, /*vocab_size=*/1000);
  ASSERT_FALSE(small.ok());
  EXPECT_THAT(small.status().message(), HasSubstr("vocab_size 1000"));
}

TEST(PackingTest, PacksWholeDocumentsInFileOrder) {
  TempDir dir;
  const std::string path = (dir.path() / "d.stk").string();
  ASSERT_TRUE(WritePreparedData(path, Documents({5, 4, 8, 3, 10})).ok());
  const PreparedTokens data = Open(path);
  PackingOptions o;
  o.seq_len = 9;  // rows of 10 tokens
  o.pad_token = 7;
  auto plan = PlanPacking(data, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  // [5 4 | pad 1] [8 | pad 2] [3 | pad 7] [10]: a row ends where the next document does not fit.
  ASSERT_EQ(plan->rows(), 4u);
  EXPECT_EQ(plan->row_begin, (std::vector<uint64_t>{0, 2, 3, 4, 5}));
  EXPECT_EQ(plan->pad_tokens, 1u + 2u + 7u);
  EXPECT_EQ(plan->split_documents, 0u);

  const Row r0 = ReadRow(data, *plan, o, 0);
  const std::vector<int32_t> tokens = {0, 1, 2, 3, 4, 1000, 1001, 1002, 1003, 7};
  EXPECT_EQ(r0.tokens, tokens);
  // Each document's inputs predict its next token; the last token of a document predicts
  // nothing (the next document is not its continuation), nor do pads.
  EXPECT_EQ(r0.targets, (std::vector<int32_t>{1, 2, 3, 4, -100, 1001, 1002, 1003, -100}));
  EXPECT_EQ(r0.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3}));
  EXPECT_EQ(r0.key_start, (std::vector<int32_t>{0, 0, 0, 0, 0, 5, 5, 5, 5}));
  EXPECT_EQ(r0.trained, 4u + 3u);
  // The row that one document fills exactly: its last token is the last input's target.
  const Row r3 = ReadRow(data, *plan, o, 3);
  EXPECT_EQ(r3.targets.back(), 4009);
  EXPECT_EQ(r3.trained, 9u);
  // Pads see only themselves.
  const Row r2 = ReadRow(data, *plan, o, 2);
  EXPECT_EQ(r2.key_start, (std::vector<int32_t>{0, 0, 0, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(r2.targets, (std::vector<int32_t>{3001, 3002, -100, -100, -100, -100, -100, -100, -100}));
  EXPECT_THAT(DescribePacking(data, *plan, o), HasSubstr("5 document(s) packed into 4 row(s)"));

  // Without packing: one document per row.
  o.pack = false;
  auto single = PlanPacking(data, o);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->rows(), 5u);
  EXPECT_EQ(ReadRow(data, *single, o, 1).tokens,
            (std::vector<int32_t>{1000, 1001, 1002, 1003, 7, 7, 7, 7, 7, 7}));
}

TEST(PackingTest, MaskedTokensAreNotTargets) {
  TempDir dir;
  const std::string path = (dir.path() / "d.stk").string();
  ASSERT_TRUE(WritePreparedData(path, Documents({6}, /*untrained=*/3)).ok());
  const PreparedTokens data = Open(path);
  PackingOptions o;
  o.seq_len = 8;
  auto plan = PlanPacking(data, o);
  ASSERT_TRUE(plan.ok());
  const Row r = ReadRow(data, *plan, o, 0);
  // Tokens 0-2 are the prompt: inputs 0 and 1 predict prompt tokens (not trained); input 2
  // predicts token 3, the first trained one.
  EXPECT_EQ(r.targets, (std::vector<int32_t>{-100, -100, 3, 4, 5, -100, -100, -100}));
  EXPECT_EQ(r.trained, 3u);
  auto counted = TrainedTargets(data, *plan, 0);
  ASSERT_TRUE(counted.ok());
  EXPECT_EQ(*counted, 3u);
}

TEST(PackingTest, LongDocumentsSplitTrainEveryTargetOnceOrAreDropped) {
  TempDir dir;
  const std::string path = (dir.path() / "d.stk").string();
  ASSERT_TRUE(WritePreparedData(path, Documents({25, 3})).ok());
  const PreparedTokens data = Open(path);
  PackingOptions o;
  o.seq_len = 9;
  auto plan = PlanPacking(data, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->split_documents, 1u);
  // Pieces [0, 10), [9, 19) fill rows; the rest [18, 25) packs with the next document.
  ASSERT_EQ(plan->rows(), 3u);
  std::multiset<std::pair<int32_t, int32_t>> pairs;  // (input, target) of document 0
  uint64_t trained = 0;
  for (uint64_t r = 0; r < plan->rows(); ++r) {
    const Row row = ReadRow(data, *plan, o, r);
    trained += row.trained;
    for (size_t i = 0; i < row.targets.size(); ++i) {
      if (row.targets[i] >= 0 && row.targets[i] < 1000) pairs.insert({row.tokens[i], row.targets[i]});
      // Positions restart at every piece.
      if (row.key_start[i] == static_cast<int32_t>(i)) {
        EXPECT_EQ(row.positions[i], 0);
      }
    }
  }
  EXPECT_EQ(trained, 24u + 2u);
  ASSERT_EQ(pairs.size(), 24u);
  int32_t expect = 0;
  for (const auto& [in, target] : pairs) {
    EXPECT_EQ(in, expect);
    EXPECT_EQ(target, expect + 1);
    ++expect;
  }
  // Dropped: only the short document is left.
  o.long_documents = LongDocuments::kDrop;
  auto dropped = PlanPacking(data, o);
  ASSERT_TRUE(dropped.ok());
  EXPECT_EQ(dropped->rows(), 1u);
  EXPECT_EQ(dropped->dropped_documents, 1u);
  EXPECT_EQ(dropped->dropped_tokens, 25u);  // the 3-token document is left
  EXPECT_THAT(DescribePacking(data, *dropped, o), HasSubstr("1 longer than a row dropped"));
  // Nothing left at all is an error naming the file.
  ASSERT_TRUE(WritePreparedData(path, Documents({25})).ok());
  const PreparedTokens only_long = Open(path);
  auto none = PlanPacking(only_long, o);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(none.status().message(), HasSubstr(path));
}

// Random documents and masks: TrainedTargets agrees with ReadPackedRow, every trained target of
// the file is trained once, and key starts never decrease along a row.
TEST(PackingTest, TrainedTargetsAgreeWithTheRowsOnRandomDocuments) {
  TempDir dir;
  const std::string path = (dir.path() / "d.stk").string();
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    std::mt19937 rng(seed);
    PreparedDocuments in;
    uint64_t want = 0;  // trained targets: mask bits after a document's first token
    for (int d = 0; d < 40; ++d) {
      const size_t n = 1 + rng() % 40;
      in.documents.emplace_back(n);
      in.masks.emplace_back(n);
      for (size_t i = 0; i < n; ++i) {
        in.documents.back()[i] = rng() % 500;
        in.masks.back()[i] = (rng() % 3) != 0;
        if (i > 0) want += in.masks.back()[i];
      }
    }
    ASSERT_TRUE(WritePreparedData(path, in).ok());
    const PreparedTokens data = Open(path);
    for (const bool pack : {true, false}) {
      PackingOptions o;
      o.seq_len = 16;
      o.pack = pack;
      auto plan = PlanPacking(data, o);
      ASSERT_TRUE(plan.ok());
      uint64_t got = 0;
      for (uint64_t r = 0; r < plan->rows(); ++r) {
        const Row row = ReadRow(data, *plan, o, r);
        auto counted = TrainedTargets(data, *plan, r);
        ASSERT_TRUE(counted.ok());
        EXPECT_EQ(*counted, row.trained) << "seed " << seed << " row " << r;
        got += row.trained;
        for (size_t i = 1; i < row.key_start.size(); ++i) {
          EXPECT_LE(row.key_start[i - 1], row.key_start[i]);
        }
      }
      EXPECT_EQ(got, want) << "seed " << seed << (pack ? " packed" : " one per row");
    }
  }
}

// The engine averages micro-batch losses over ranks x micro-batches; the weights turn that into
// the mean over the global batch's trained tokens.
TEST(PackingTest, LossWeightsGiveTheMeanOverTheGlobalBatch) {
  // Two ranks, three micro-batches each: trained targets and summed losses per micro-batch.
  const std::vector<std::vector<uint64_t>> n = {{10, 0, 3}, {7, 7, 1}};
  const std::vector<std::vector<double>> sum = {{20.0, 0.0, 9.0}, {3.5, 14.0, 4.0}};
  uint64_t global = 0;
  double total = 0;
  for (int r = 0; r < 2; ++r) {
    for (int a = 0; a < 3; ++a) {
      global += n[r][a];
      total += sum[r][a];
    }
  }
  double engine = 0;  // what the engine computes: sum of weighted means / (ranks x micro-batches)
  for (int r = 0; r < 2; ++r) {
    const std::vector<double> w = LossWeights(n[r], global, 2);
    for (int a = 0; a < 3; ++a) {
      const double mean = n[r][a] > 0 ? sum[r][a] / static_cast<double>(n[r][a]) : 0.0;
      engine += w[a] * mean;
    }
  }
  EXPECT_NEAR(engine / 6.0, total / static_cast<double>(global), 1e-12);
  EXPECT_EQ(LossWeights(std::vector<uint64_t>{0, 0}, 0, 1), (std::vector<double>{0.0, 0.0}));
}

TEST(TrainingDataTest, OpensAStreamOrPreparedDataAndReadsRows) {
  TempDir dir;
  const std::string prepared = (dir.path() / "d.stk").string();
  ASSERT_TRUE(WritePreparedData(prepared, Documents({5, 4, 8, 3, 10}, 1)).ok());
  DataOptions o;
  o.vocab_size = 5000;
  o.seq_len = 9;
  auto data = TrainingData::Open(prepared, o);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_TRUE((*data)->prepared());
  EXPECT_EQ((*data)->rows(), 4u);
  EXPECT_EQ((*data)->options().pad_token, 7);  // no pad id in the file: its EOS
  model::LlamaBatch mb;
  const uint64_t rows[2] = {3, 0};
  auto trained = (*data)->Read(rows, &mb);
  ASSERT_TRUE(trained.ok());
  EXPECT_EQ(mb.tokens.size(), 20u);
  EXPECT_EQ(mb.targets.size(), 18u);
  EXPECT_EQ(mb.tokens[0], 4000);
  EXPECT_EQ(mb.tokens[10], 0);
  auto counted = (*data)->TrainedTargets(rows);
  ASSERT_TRUE(counted.ok());
  EXPECT_EQ(*counted, *trained);
  EXPECT_EQ(*trained, 9u + (4u + 3u));
  EXPECT_THAT((*data)->Describe(), HasSubstr("packed into 4 row(s)"));

  // A token stream: windows, every next token a target, no packing fields.
  const std::string stream = (dir.path() / "t.bin").string();
  {
    std::ofstream f(stream, std::ios::binary);
    for (uint16_t t = 0; t < 50; ++t) f.write(reinterpret_cast<const char*>(&t), 2);
  }
  auto s = TrainingData::Open(stream, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE((*s)->prepared());
  EXPECT_EQ((*s)->rows(), 49u / 9u);
  const uint64_t window[1] = {2};
  auto n = (*s)->Read(window, &mb);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 9u);
  EXPECT_EQ(mb.tokens.front(), 18);
  EXPECT_EQ(mb.tokens.back(), 27);
  EXPECT_TRUE(mb.targets.empty());
  EXPECT_TRUE(mb.positions.empty());
}

TEST(TrainingDataTest, ASamplerOverRowsOrdersThemAsOverWindows) {
  TempDir dir;
  const std::string stream = (dir.path() / "t.bin").string();
  {
    std::ofstream f(stream, std::ios::binary);
    for (uint16_t t = 0; t < 400; ++t) f.write(reinterpret_cast<const char*>(&t), 2);
  }
  auto data = TokenDataset::Open(stream, 1000);
  ASSERT_TRUE(data.ok());
  SamplerOptions so{.seq_len = 7, .global_batch = 6, .mode = SamplingMode::kRandom, .seed = 3};
  auto windows = SequenceSampler::Create(&*data, so);
  auto rows = SequenceSampler::Create(windows->num_windows(), "rows", so);
  ASSERT_TRUE(windows.ok() && rows.ok());
  const BatchLayout layout{.world_size = 2, .micro_batch = 1, .grad_accum = 3};
  for (uint64_t step = 0; step < 20; ++step) {
    auto all = rows->GlobalBatchWindows(step);
    ASSERT_TRUE(all.ok());
    EXPECT_EQ(*all, *windows->GlobalBatchWindows(step));
    for (int r = 0; r < 2; ++r) {
      for (int a = 0; a < 3; ++a) {
        auto mine = rows->RankWindows(step, layout, r, a);
        ASSERT_TRUE(mine.ok());
        EXPECT_EQ((*mine)[0], (*all)[GlobalBatchIndex(layout, r, a, 0)]);
      }
    }
  }
  std::vector<int32_t> out(8);
  const Status read = rows->ReadRankBatch(0, layout, 0, 0, out);
  EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition);
  auto few = SequenceSampler::Create(5, "few.stk", so);
  ASSERT_FALSE(few.ok());
  EXPECT_THAT(few.status().message(), HasSubstr("few.stk: 5 rows"));
}

}  // namespace
}  // namespace strata::train
