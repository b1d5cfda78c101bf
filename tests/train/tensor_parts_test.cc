// Tensor-parallel parts in whole-tensor files (train/tensor_parts.h): the runs a range of a part
// occupies, which rank writes each part, and column parts written by several ranks as strided
// ranges that the checksum manifest tiles, verifies and reads back.
#include "train/tensor_parts.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/llama_config.h"
#include "test_support.h"
#include "train/checksum_manifest.h"
#include "train/safetensors.h"

namespace strata::train {
namespace {

using model::TensorSlice;

// The whole tensor's element of each element [offset, offset + count) of the part, by the runs.
std::vector<uint64_t> Mapped(const TensorPart& part, uint64_t offset, uint64_t count) {
  std::vector<uint64_t> out(count, ~uint64_t{0});
  const std::vector<PartRun> runs = TensorParts::Runs(&part, offset, count);
  EXPECT_LE(runs.size(), 3u);
  for (const PartRun& r : runs) {
    for (uint64_t c = 0; c < r.chunks; ++c) {
      for (uint64_t i = 0; i < r.chunk; ++i) {
        const uint64_t local = r.part_offset + c * r.chunk + i;
        EXPECT_LT(local, count);
        if (local < count) out[local] = r.offset + c * r.stride + i;
      }
    }
  }
  return out;
}

TEST(TensorPartsTest, RunsCoverExactlyThePartsElementsInTheWholeTensor) {
  // Columns [4, 7) of a [5, 12] matrix, and rows [2, 4) of a [6, 4] one.
  const TensorPart columns{{5, 12}, TensorSlice{1, 4, 3}, true};
  const TensorPart rows{{6, 4}, TensorSlice{0, 2, 2}, true};
  for (uint64_t offset = 0; offset <= 15; ++offset) {
    for (uint64_t count = 0; offset + count <= 15; ++count) {
      std::vector<uint64_t> want;
      for (uint64_t e = offset; e < offset + count; ++e)
        want.push_back(e / 3 * 12 + 4 + e % 3);
      EXPECT_EQ(Mapped(columns, offset, count), want) << offset << "+" << count;
    }
  }
  for (uint64_t offset = 0; offset <= 8; ++offset) {
    for (uint64_t count = 0; offset + count <= 8; ++count) {
      std::vector<uint64_t> want;
      for (uint64_t e = offset; e < offset + count; ++e)
        want.push_back(8 + e);
      EXPECT_EQ(Mapped(rows, offset, count), want) << offset << "+" << count;
    }
  }
  const std::vector<PartRun> whole = TensorParts::Runs(nullptr, 5, 7);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(whole[0].offset, 5u);
  EXPECT_EQ(whole[0].chunk, 7u);
}

model::LlamaConfig Tiny() {
  model::LlamaConfig c;
  c.name = "parts-tiny";
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

TEST(TensorPartsTest, EachPartHasOneWriterAndTheWholeShape) {
  const model::LlamaConfig c = Tiny();
  EXPECT_TRUE(TensorParts::For(c, {}, false, 0, 1).whole());
  // TP 4 with 2 KV heads: each KV head on 2 ranks; the norms on all 4.
  std::map<std::string, int> writers;
  for (int r = 0; r < 4; ++r) {
    const TensorParts parts = TensorParts::For(c, {}, false, r, 4);
    const TensorPart* q = parts.Find("model.layers.1.self_attn.q_proj.weight");
    ASSERT_NE(q, nullptr);
    EXPECT_EQ(q->whole_shape, (std::vector<uint64_t>{32, 32}));
    EXPECT_EQ(q->slice.dim, 0);
    EXPECT_EQ(q->slice.begin, r * 8);
    const TensorPart* o = parts.Find("model.layers.0.self_attn.o_proj.weight");
    ASSERT_NE(o, nullptr);
    EXPECT_EQ(o->slice.dim, 1);
    const TensorPart* k = parts.Find("model.layers.0.self_attn.k_proj.weight");
    ASSERT_NE(k, nullptr);
    EXPECT_EQ(k->whole_shape, (std::vector<uint64_t>{16, 32}));
    EXPECT_EQ(k->slice.begin, r / 2 * 8);
    for (const char* name :
         {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
          "model.layers.0.input_layernorm.weight", "model.norm.weight",
          "model.embed_tokens.weight"}) {
      writers[name] += parts.Find(name)->writes ? 1 : 0;
    }
  }
  EXPECT_EQ(writers["model.layers.0.self_attn.q_proj.weight"], 4);
  EXPECT_EQ(writers["model.layers.0.self_attn.k_proj.weight"], 2);
  EXPECT_EQ(writers["model.layers.0.input_layernorm.weight"], 1);
  EXPECT_EQ(writers["model.norm.weight"], 1);
  EXPECT_EQ(writers["model.embed_tokens.weight"], 4);
}

// Three ranks write columns [0, 4), [4, 8), [8, 12) of a [5, 12] matrix, each in two pieces cut
// mid-row, as strided ranges; a fourth tensor is whole. The manifest tiles the file, the file
// reads back as the whole matrix, and a damaged byte in one rank's columns is found.
TEST(TensorPartsTest, ColumnPartsFromSeveralRanksTileVerifyAndReadBack) {
  testing::TempDir dir;
  const std::string file = "optimizer.safetensors";
  const std::string path = dir.file(file);
  Result<SafetensorsLayout> layout = SafetensorsLayout::Compute(
      {{"w", SafetensorsDType::kF32, {5, 12}}, {"b", SafetensorsDType::kBF16, {6}}});
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  std::vector<float> whole(60);
  for (size_t i = 0; i < whole.size(); ++i)
    whole[i] = static_cast<float>(i) * 0.5f - 3.0f;
  for (int rank = 0; rank < 3; ++rank) {
    Result<std::unique_ptr<SafetensorsWriter>> w = rank == 0
                                                       ? SafetensorsWriter::Create(path, *layout)
                                                       : SafetensorsWriter::Open(path, *layout);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    const TensorPart part{{5, 12}, TensorSlice{1, rank * 4, 4}, true};
    std::vector<float> mine;  // the rank's [5, 4] part, row-major
    for (int r = 0; r < 5; ++r) {
      for (int c = 0; c < 4; ++c)
        mine.push_back(whole[static_cast<size_t>(r * 12 + rank * 4 + c)]);
    }
    for (const auto& [offset, count] : {std::pair<uint64_t, uint64_t>{0, 7}, {7, 13}}) {
      for (const PartRun& run : TensorParts::Runs(&part, offset, count)) {
        ASSERT_TRUE((*w)->WriteStrided("w", run.offset, run.chunk, run.chunks, run.stride,
                                       mine.data() + offset + run.part_offset, device::DType::kF32)
                        .ok());
      }
    }
    if (rank == 2) {
      const float b[6] = {1, 2, 3, 4, 5, 6};
      ASSERT_TRUE((*w)->WriteRange("b", 0, 6, b, device::DType::kF32).ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
    bool strided = false;
    for (const auto& r : (*w)->written())
      strided = strided || r.chunks > 1;
    EXPECT_TRUE(strided) << "rank " << rank << " wrote no strided range";
    ASSERT_TRUE(WriteManifestPart(dir.path(), rank, {{file, (*w)->written()}}).ok());
  }
  ASSERT_TRUE(WriteManifest(dir.path(), 3, {}).ok());
  Result<Manifest> manifest = ReadManifest(dir.path());
  ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
  EXPECT_TRUE(VerifyManifest(dir.path(), *manifest).problems.empty());

  Result<std::unique_ptr<SafetensorsFile>> st = SafetensorsFile::Open(path);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  std::vector<float> back(60);
  ASSERT_TRUE((*st)->ReadRange("w", 0, 60, back.data(), device::DType::kF32).ok());
  EXPECT_EQ(back, whole);

  // One byte of rank 1's columns in row 3 changes on disk.
  const uint64_t at = layout->data_offset() + (3 * 12 + 5) * 4;
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, static_cast<long>(at), SEEK_SET);
    std::fputc(0x5a, f);
    std::fclose(f);
  }
  const VerifyResult damaged = VerifyManifest(dir.path(), *manifest);
  ASSERT_EQ(damaged.problems.size(), 1u);
  EXPECT_NE(damaged.problems[0].find("runs of 16 bytes every 48"), std::string::npos)
      << damaged.problems[0];
}

TEST(TensorPartsTest, AColumnPartNobodyWroteFailsTheManifest) {
  testing::TempDir dir;
  const std::string file = "model.safetensors";
  Result<SafetensorsLayout> layout =
      SafetensorsLayout::Compute({{"w", SafetensorsDType::kF32, {4, 6}}});
  ASSERT_TRUE(layout.ok());
  Result<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(dir.file(file), *layout);
  ASSERT_TRUE(w.ok());
  // Columns [0, 3) only: the other half of every row has no writer.
  const std::vector<float> part(12, 1.0f);
  ASSERT_TRUE((*w)->WriteStrided("w", 0, 3, 4, 6, part.data(), device::DType::kF32).ok());
  EXPECT_EQ((*w)->WriteStrided("w", 0, 4, 2, 3, part.data(), device::DType::kF32).code(),
            StatusCode::kInvalidArgument);  // chunks would overlap
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE(WriteManifestPart(dir.path(), 0, {{file, (*w)->written()}}).ok());
  const Status st = WriteManifest(dir.path(), 1, {});
  EXPECT_EQ(st.code(), StatusCode::kInternal);
  EXPECT_NE(st.message().find("were written by no rank"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace strata::train
