#include "train/safetensors.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "test_support.h"

namespace strata::train {
namespace {

using device::DType;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::TestWithParam;

// Deterministic values that differ in every bit position that matters for rounding.
float Value(uint64_t i, uint64_t seed) {
  return static_cast<float>(static_cast<int64_t>((i * 37 + seed * 11) % 101) - 50) / 7.0f;
}

std::vector<float> Values(uint64_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i)
    v[i] = Value(i, seed);
  return v;
}

// What a float becomes after a trip through `dtype`.
float Rounded(float f, SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kBF16:
      return device::Bf16ToFloat(device::FloatToBf16(f));
    case SafetensorsDType::kF16:
      return device::F16ToFloat(device::FloatToF16(f));
    default:
      return f;
  }
}

std::vector<float> ReadAll(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsTensor* t = file.Find(name);
  EXPECT_NE(t, nullptr) << name;
  if (t == nullptr) return {};
  std::vector<float> out(t->num_elements, -1.0f);
  Status s = file.ReadRange(name, 0, t->num_elements, out.data(), DType::kF32);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

// Writes a file made of a raw header and `data_bytes` zero bytes, bypassing our writer.
std::string WriteRaw(const testing::TempDir& dir, const std::string& name, const std::string& json,
                     size_t data_bytes, std::optional<uint64_t> length_override = std::nullopt) {
  std::string path = dir.file(name);
  std::ofstream out(path, std::ios::binary);
  uint64_t length = length_override.value_or(json.size());
  for (int i = 0; i < 8; ++i)
    out.put(static_cast<char>((length >> (8 * i)) & 0xff));
  out << json << std::string(data_bytes, '\0');
  return path;
}

// Writes every tensor of `layout` with Value(i, k) for the k-th tensor, from fp32.
void WriteAllFromFloat(SafetensorsWriter& writer) {
  uint64_t seed = 0;
  for (const SafetensorsTensor& t : writer.layout().tensors()) {
    std::vector<float> v = Values(t.num_elements, seed++);
    ASSERT_TRUE(writer.WriteRange(t.name, 0, t.num_elements, v.data(), DType::kF32).ok()) << t.name;
  }
}

std::vector<SafetensorsTensorSpec> MixedSpecs() {
  return {
      {"h.0.attn.weight", SafetensorsDType::kBF16, {7, 3}},
      {"h.0.mlp.weight", SafetensorsDType::kF16, {2, 2, 3}},
      {"wte.weight", SafetensorsDType::kF32, {5, 3}},
      {"scale", SafetensorsDType::kF32, {}},
      {"empty", SafetensorsDType::kF16, {0, 4}},
      {"odd", SafetensorsDType::kBF16, {1}},
  };
}

TEST(SafetensorsDTypeTest, NamesSizesAndDeviceDTypes) {
  EXPECT_EQ(SafetensorsDTypeName(SafetensorsDType::kBF16), "BF16");
  EXPECT_EQ(SafetensorsDTypeSize(SafetensorsDType::kF64), 8u);
  EXPECT_EQ(ParseSafetensorsDType("F8_E4M3"), SafetensorsDType::kF8E4M3);
  EXPECT_EQ(ParseSafetensorsDType("f32"), std::nullopt);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16})
    EXPECT_EQ(ToDeviceDType(ToSafetensorsDType(d)), d);
  EXPECT_EQ(ToDeviceDType(SafetensorsDType::kI32), std::nullopt);
}

TEST(SafetensorsLayoutTest, DeterministicAlignedAndContiguous) {
  Result<SafetensorsLayout> a = SafetensorsLayout::Compute(MixedSpecs(), {{"format", "pt"}});
  Result<SafetensorsLayout> b = SafetensorsLayout::Compute(MixedSpecs(), {{"format", "pt"}});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->header(), b->header());
  EXPECT_EQ(a->data_offset() % 8, 0u);
  // Largest elements first, caller's order within a size, no gaps.
  std::vector<std::string> order;
  uint64_t expected_begin = 0;
  for (const SafetensorsTensor& t : a->tensors()) {
    order.push_back(t.name);
    EXPECT_EQ(t.data_begin, expected_begin) << t.name;
    EXPECT_EQ(t.file_offset % SafetensorsDTypeSize(t.dtype), 0u) << t.name;
    expected_begin = t.data_end;
  }
  EXPECT_THAT(order, ::testing::ElementsAre("wte.weight", "scale", "h.0.attn.weight",
                                            "h.0.mlp.weight", "empty", "odd"));
  EXPECT_EQ(a->data_size(), expected_begin);
  EXPECT_EQ(a->data_size(), 15u * 4 + 4 + 21 * 2 + 12 * 2 + 0 + 2);
  // The JSON is valid on its own (padding is whitespace) and starts with '{'.
  std::string json = a->header().substr(8);
  EXPECT_EQ(json.front(), '{');
  nlohmann::json parsed = nlohmann::json::parse(json);
  EXPECT_EQ(parsed["__metadata__"]["format"], "pt");
  EXPECT_EQ(parsed["scale"]["shape"], nlohmann::json::array());
}

TEST(SafetensorsLayoutTest, RejectsBadTensorLists) {
  auto error = [](std::vector<SafetensorsTensorSpec> specs) {
    Result<SafetensorsLayout> r = SafetensorsLayout::Compute(specs);
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.status().ToString();
  };
  EXPECT_THAT(error({{"a", SafetensorsDType::kF32, {1}}, {"a", SafetensorsDType::kF16, {2}}}),
              HasSubstr("'a' appears more than once"));
  EXPECT_THAT(error({{"", SafetensorsDType::kF32, {1}}}), HasSubstr("empty name"));
  EXPECT_THAT(error({{"__metadata__", SafetensorsDType::kF32, {1}}}), HasSubstr("reserved"));
  EXPECT_THAT(error({{"big", SafetensorsDType::kF32, {1ull << 40, 1ull << 40}}}),
              HasSubstr("too large"));
}

TEST(SafetensorsTest, RoundTripWithConversion) {
  testing::TempDir dir;
  Result<SafetensorsLayout> layout =
      SafetensorsLayout::Compute(MixedSpecs(), {{"format", "pt"}, {"step", "12"}});
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const std::string tmp = dir.file("model.safetensors.tmp");
  const std::string path = dir.file("model.safetensors");
  {
    Result<std::unique_ptr<SafetensorsWriter>> writer = SafetensorsWriter::Create(tmp, *layout);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    WriteAllFromFloat(**writer);
    ASSERT_TRUE((*writer)->Finish().ok());
    EXPECT_EQ((*writer)->WriteRange("scale", 0, 1, "abcd", DType::kF32).code(),
              StatusCode::kFailedPrecondition);
    EXPECT_TRUE((*writer)->Finish().ok());
  }
  ASSERT_TRUE(LocalFileSystem().Rename(tmp, path).ok());
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_EQ(std::filesystem::file_size(path), layout->file_size());

  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->metadata().at("step"), "12");
  EXPECT_EQ((*file)->data_offset(), layout->data_offset());
  ASSERT_EQ((*file)->tensors().size(), layout->tensors().size());
  uint64_t seed = 0;
  for (const SafetensorsTensor& expected : layout->tensors()) {
    const SafetensorsTensor* t = (*file)->Find(expected.name);
    ASSERT_NE(t, nullptr) << expected.name;
    EXPECT_EQ(t->dtype, expected.dtype);
    EXPECT_EQ(t->shape, expected.shape);
    EXPECT_EQ(t->file_offset, expected.file_offset);
    std::vector<float> want = Values(expected.num_elements, seed++);
    for (float& f : want)
      f = Rounded(f, expected.dtype);
    EXPECT_EQ(ReadAll(**file, expected.name), want) << expected.name;
  }

  // Reading into a 16-bit buffer: the same dtype is a byte copy, another converts once.
  std::vector<uint16_t> bf(21), half(15);
  ASSERT_TRUE((*file)->ReadRange("h.0.attn.weight", 0, 21, bf.data(), DType::kBF16).ok());
  ASSERT_TRUE((*file)->ReadRange("wte.weight", 0, 15, half.data(), DType::kF16).ok());
  const uint64_t attn_seed = 2, wte_seed = 0;  // positions in data order
  for (uint64_t i = 0; i < 21; ++i)
    EXPECT_EQ(bf[i], device::FloatToBf16(Value(i, attn_seed))) << i;
  for (uint64_t i = 0; i < 15; ++i)
    EXPECT_EQ(half[i], device::FloatToF16(Value(i, wte_seed))) << i;
}

TEST(SafetensorsTest, PartialRangesAcrossTheBounceBuffer) {
  testing::TempDir dir;
  const uint64_t n = 150001;  // more than two bounce buffers, not a multiple of anything
  Result<SafetensorsLayout> layout = SafetensorsLayout::Compute(
      {{"w", SafetensorsDType::kBF16, {n}}, {"v", SafetensorsDType::kF32, {n}}});
  ASSERT_TRUE(layout.ok());
  const std::string path = dir.file("p.safetensors");
  std::vector<float> values = Values(n, 5);
  {
    Result<std::unique_ptr<SafetensorsWriter>> writer = SafetensorsWriter::Create(path, *layout);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    // Uneven pieces, out of order, from different source dtypes.
    std::vector<uint16_t> as_f16(n);
    for (uint64_t i = 0; i < n; ++i)
      as_f16[i] = device::FloatToF16(values[i]);
    const uint64_t cuts[] = {0, 1, 70000, 70001, n};
    for (int k = 3; k >= 0; --k) {
      uint64_t b = cuts[k], e = cuts[k + 1];
      ASSERT_TRUE((*writer)->WriteRange("w", b, e - b, values.data() + b, DType::kF32).ok());
      ASSERT_TRUE((*writer)->WriteRange("v", b, e - b, as_f16.data() + b, DType::kF16).ok());
    }
    EXPECT_EQ((*writer)->WriteRange("w", n - 1, 2, values.data(), DType::kF32).code(),
              StatusCode::kOutOfRange);
    EXPECT_EQ((*writer)->WriteRange("nope", 0, 1, values.data(), DType::kF32).code(),
              StatusCode::kNotFound);
    ASSERT_TRUE((*writer)->Finish().ok());
  }
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  struct Range {
    uint64_t begin, count;
  };
  for (Range r : {Range{0, 1}, Range{n - 1, 1}, Range{12345, 100000}, Range{3, 0}, Range{0, n}}) {
    std::vector<float> w(r.count), v(r.count);
    ASSERT_TRUE((*file)->ReadRange("w", r.begin, r.count, w.data(), DType::kF32).ok());
    ASSERT_TRUE((*file)->ReadRange("v", r.begin, r.count, v.data(), DType::kF32).ok());
    for (uint64_t i = 0; i < r.count; ++i) {
      ASSERT_EQ(w[i], Rounded(values[r.begin + i], SafetensorsDType::kBF16)) << r.begin + i;
      ASSERT_EQ(v[i], Rounded(values[r.begin + i], SafetensorsDType::kF16)) << r.begin + i;
    }
  }
  float x;
  Status past = (*file)->ReadRange("w", n, 1, &x, DType::kF32);
  EXPECT_EQ(past.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(past.ToString(), AllOf(HasSubstr(path), HasSubstr("'w'")));
  Status missing = (*file)->ReadRange("nope", 0, 1, &x, DType::kF32);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.ToString(), AllOf(HasSubstr(path), HasSubstr("'nope'")));
}

TEST(SafetensorsTest, TwoProcessesWriteDisjointHalves) {
  testing::TempDir dir;
  const std::vector<SafetensorsTensorSpec> specs = {{"a", SafetensorsDType::kF32, {1001}},
                                                    {"b", SafetensorsDType::kBF16, {33, 3}}};
  Result<SafetensorsLayout> layout = SafetensorsLayout::Compute(specs);
  ASSERT_TRUE(layout.ok());
  const std::string tmp = dir.file("shared.safetensors.tmp");
  Result<std::unique_ptr<SafetensorsWriter>> creator = SafetensorsWriter::Create(tmp, *layout);
  ASSERT_TRUE(creator.ok()) << creator.status().ToString();
  const std::vector<float> a = Values(1001, 1), b = Values(99, 2);

  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The second "rank": its own layout from the same list, its own descriptor, second halves.
    Result<SafetensorsLayout> mine = SafetensorsLayout::Compute(specs);
    if (!mine.ok()) ::_exit(2);
    Result<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Open(tmp, *mine);
    if (!w.ok()) ::_exit(3);
    bool ok = (*w)->WriteRange("a", 500, 501, a.data() + 500, DType::kF32).ok() &&
              (*w)->WriteRange("b", 50, 49, b.data() + 50, DType::kF32).ok() && (*w)->Finish().ok();
    ::_exit(ok ? 0 : 4);
  }
  ASSERT_TRUE((*creator)->WriteRange("a", 0, 500, a.data(), DType::kF32).ok());
  ASSERT_TRUE((*creator)->WriteRange("b", 0, 50, b.data(), DType::kF32).ok());
  ASSERT_TRUE((*creator)->Finish().ok());
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  ASSERT_EQ(WEXITSTATUS(wstatus), 0);

  const std::string path = dir.file("shared.safetensors");
  ASSERT_TRUE(LocalFileSystem().Rename(tmp, path).ok());
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(ReadAll(**file, "a"), a);
  std::vector<float> b_rounded = b;
  for (float& f : b_rounded)
    f = Rounded(f, SafetensorsDType::kBF16);
  EXPECT_EQ(ReadAll(**file, "b"), b_rounded);
}

TEST(SafetensorsTest, OpenForWritingChecksTheFileMatchesTheLayout) {
  testing::TempDir dir;
  Result<SafetensorsLayout> layout =
      SafetensorsLayout::Compute({{"a", SafetensorsDType::kF32, {4}}});
  Result<SafetensorsLayout> other =
      SafetensorsLayout::Compute({{"b", SafetensorsDType::kF32, {4}}});
  ASSERT_TRUE(layout.ok() && other.ok());
  const std::string path = dir.file("x.safetensors");
  Result<std::unique_ptr<SafetensorsWriter>> missing = SafetensorsWriter::Open(path, *layout);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().ToString(), HasSubstr(path));
  ASSERT_TRUE(SafetensorsWriter::Create(path, *layout).ok());
  Result<std::unique_ptr<SafetensorsWriter>> wrong = SafetensorsWriter::Open(path, *other);
  EXPECT_EQ(wrong.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(wrong.status().ToString(), AllOf(HasSubstr(path), HasSubstr("header differs")));
  Result<SafetensorsLayout> bigger =
      SafetensorsLayout::Compute({{"a", SafetensorsDType::kF32, {5}}});
  ASSERT_TRUE(bigger.ok());
  Result<std::unique_ptr<SafetensorsWriter>> size = SafetensorsWriter::Open(path, *bigger);
  EXPECT_EQ(size.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(SafetensorsWriter::Open(path, *layout).ok());
}

// Writes one shard holding `specs` with values from WriteAllFromFloat.
void WriteShard(const std::string& path, const std::vector<SafetensorsTensorSpec>& specs) {
  Result<SafetensorsLayout> layout = SafetensorsLayout::Compute(specs);
  ASSERT_TRUE(layout.ok());
  Result<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(path + ".tmp", *layout);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  WriteAllFromFloat(**w);
  ASSERT_TRUE((*w)->Finish().ok());
  ASSERT_TRUE(LocalFileSystem().Rename(path + ".tmp", path).ok());
}

TEST(SafetensorsModelTest, ShardedDirectoryIsOneNamespace) {
  testing::TempDir dir;
  WriteShard(dir.file("model-00001-of-00002.safetensors"),
             {{"a", SafetensorsDType::kF32, {3}}, {"b", SafetensorsDType::kBF16, {2}}});
  WriteShard(dir.file("model-00002-of-00002.safetensors"), {{"c", SafetensorsDType::kF16, {4}}});
  const std::string index = dir.file(std::string(kSafetensorsIndexFile));
  ASSERT_TRUE(WriteSafetensorsIndex(index + ".tmp", 12 + 4 + 8,
                                    {{"a", "model-00001-of-00002.safetensors"},
                                     {"b", "model-00001-of-00002.safetensors"},
                                     {"c", "model-00002-of-00002.safetensors"}})
                  .ok());
  ASSERT_TRUE(LocalFileSystem().Rename(index + ".tmp", index).ok());
  nlohmann::json parsed = nlohmann::json::parse(std::ifstream(index));
  EXPECT_EQ(parsed["metadata"]["total_size"], 24);

  Result<std::unique_ptr<SafetensorsModel>> model = SafetensorsModel::Open(dir.path().string());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_EQ((*model)->source(), index);
  EXPECT_THAT((*model)->TensorNames(), ::testing::ElementsAre("a", "b", "c"));
  EXPECT_EQ((*model)->files().size(), 2u);
  std::vector<float> c(4);
  ASSERT_TRUE((*model)->ReadRange("c", 0, 4, c.data(), DType::kF32).ok());
  std::vector<float> want = Values(4, 0);
  for (float& f : want)
    f = Rounded(f, SafetensorsDType::kF16);
  EXPECT_EQ(c, want);
  float b1;
  ASSERT_TRUE((*model)->ReadRange("b", 1, 1, &b1, DType::kF32).ok());
  EXPECT_EQ(b1, Rounded(Value(1, 1), SafetensorsDType::kBF16));
  Result<const SafetensorsTensor*> a = (*model)->Find("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->shape, std::vector<uint64_t>{3});
  Status missing = (*model)->ReadRange("zz", 0, 1, &b1, DType::kF32);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.ToString(), AllOf(HasSubstr(index), HasSubstr("'zz'")));

  // A single model.safetensors wins over the index, as in transformers.
  WriteShard(dir.file(std::string(kSafetensorsModelFile)), {{"only", SafetensorsDType::kF32, {1}}});
  model = SafetensorsModel::Open(dir.path().string());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  EXPECT_THAT((*model)->TensorNames(), ::testing::ElementsAre("only"));
}

TEST(SafetensorsModelTest, IndexErrorsNameTheIndexAndTheShard) {
  testing::TempDir dir;
  WriteShard(dir.file("s1.safetensors"), {{"a", SafetensorsDType::kF32, {3}}});
  const std::string index = dir.file(std::string(kSafetensorsIndexFile));
  auto open_with = [&](const std::string& text) {
    std::ofstream(index, std::ios::trunc) << text;
    Result<std::unique_ptr<SafetensorsModel>> m = SafetensorsModel::Open(dir.path().string());
    EXPECT_FALSE(m.ok()) << text;
    return m.ok() ? Status::Ok() : m.status();
  };
  Status s = open_with(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("s2.safetensors")));
  s = open_with(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("'b'"), HasSubstr("s1.safetensors")));
  s = open_with(R"({"metadata": {}})");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("weight_map")));
  s = open_with(R"({"weight_map": {"a": "../s1.safetensors"}})");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("inside the index's directory")));
  s = open_with("{not json");
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("not valid JSON")));
  // A broken shard: the error names both the shard and the index.
  std::ofstream(dir.file("s1.safetensors"), std::ios::trunc) << "abc";
  s = open_with(R"({"weight_map": {"a": "s1.safetensors"}})");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(index), HasSubstr("s1.safetensors"),
                                  HasSubstr("shorter than the 8-byte header length")));

  testing::TempDir empty;
  Result<std::unique_ptr<SafetensorsModel>> none = SafetensorsModel::Open(empty.path().string());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(none.status().ToString(), HasSubstr(empty.path().string()));
}

struct BadFile {
  const char* label;
  std::string json;
  size_t data_bytes;
  StatusCode code;
  const char* message;
};

class SafetensorsBadFileTest : public TestWithParam<BadFile> {};

TEST_P(SafetensorsBadFileTest, ClearErrorNamingTheFile) {
  testing::TempDir dir;
  const BadFile& bad = GetParam();
  std::string path =
      WriteRaw(dir, std::string(bad.label) + ".safetensors", bad.json, bad.data_bytes);
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok()) << bad.label;
  EXPECT_EQ(file.status().code(), bad.code) << file.status().ToString();
  EXPECT_THAT(file.status().ToString(), AllOf(HasSubstr(path), HasSubstr(bad.message)));
}

const char* const kF32x2 = R"("dtype": "F32", "shape": [2])";

INSTANTIATE_TEST_SUITE_P(
    Header, SafetensorsBadFileTest,
    ::testing::Values(
        BadFile{"not_json", "{\"a\": ", 0, StatusCode::kInvalidArgument, "not valid JSON"},
        BadFile{"array", "[1, 2]", 0, StatusCode::kInvalidArgument, "expected an object"},
        BadFile{"no_dtype", R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", 8,
                StatusCode::kInvalidArgument, "tensor 'a': entry has no \"dtype\""},
        BadFile{"no_shape", R"({"a": {"dtype": "F32", "data_offsets": [0, 8]}})", 8,
                StatusCode::kInvalidArgument, "tensor 'a': entry has no \"shape\""},
        BadFile{"no_offsets", std::string("{\"a\": {") + kF32x2 + "}}", 8,
                StatusCode::kInvalidArgument, "tensor 'a': entry has no \"data_offsets\""},
        BadFile{"unknown_dtype", R"({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})",
                8, StatusCode::kInvalidArgument, "unknown dtype \"F33\""},
        BadFile{"negative_shape",
                R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8,
                StatusCode::kInvalidArgument, "non-negative integers"},
        BadFile{"past_data", std::string("{\"a\": {") + kF32x2 + ", \"data_offsets\": [4, 12]}}", 8,
                StatusCode::kDataLoss, "past the end of the data section (8 bytes)"},
        BadFile{"wrong_size", std::string("{\"a\": {") + kF32x2 + ", \"data_offsets\": [0, 6]}}", 8,
                StatusCode::kInvalidArgument, "span 6 bytes, but shape [2] of F32 needs 8"},
        BadFile{"reversed", std::string("{\"a\": {") + kF32x2 + ", \"data_offsets\": [8, 0]}}", 8,
                StatusCode::kInvalidArgument, "ends before it begins"},
        BadFile{"overlap",
                std::string("{\"a\": {") + kF32x2 + ", \"data_offsets\": [0, 8]}, \"b\": {" +
                    kF32x2 + ", \"data_offsets\": [4, 12]}}",
                12, StatusCode::kInvalidArgument,
                "'a' (bytes [0, 8)) and 'b' (bytes [4, 12)) overlap"},
        BadFile{"duplicate",
                std::string("{\"a\": {") + kF32x2 + ", \"data_offsets\": [0, 8]}, \"a\": {" +
                    kF32x2 + ", \"data_offsets\": [0, 8]}}",
                8, StatusCode::kInvalidArgument, "the key 'a' more than once"},
        BadFile{"metadata", R"({"__metadata__": {"step": 3}})", 0, StatusCode::kInvalidArgument,
                "\"__metadata__\" key 'step' is a JSON number, expected a string"}),
    [](const ::testing::TestParamInfo<BadFile>& p) { return std::string(p.param.label); });

TEST(SafetensorsFileTest, ShortFileAndHeaderPastTheEnd) {
  testing::TempDir dir;
  std::string tiny = dir.file("tiny.safetensors");
  std::ofstream(tiny) << "abcd";
  Result<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(tiny);
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(f.status().ToString(), AllOf(HasSubstr(tiny), HasSubstr("4 bytes long")));

  std::string longer = WriteRaw(dir, "long.safetensors", "{}", 0, /*length_override=*/1000);
  f = SafetensorsFile::Open(longer);
  EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(f.status().ToString(),
              AllOf(HasSubstr(longer), HasSubstr("1000 bytes long"), HasSubstr("only 2 bytes")));

  std::string absent = dir.file("absent.safetensors");
  f = SafetensorsFile::Open(absent);
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(f.status().ToString(), HasSubstr(absent));
}

TEST(SafetensorsFileTest, HolesAndEmptyTensorsAreAccepted) {
  testing::TempDir dir;
  // Another writer's file: a gap before 'b', an empty tensor sharing an offset, padding spaces.
  std::string path = WriteRaw(dir, "holes.safetensors",
                              R"({"b": {"dtype": "I32", "shape": [1], "data_offsets": [8, 12]},)"
                              R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},)"
                              R"( "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}   )",
                              12);
  Result<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ((*f)->tensors().size(), 3u);
  EXPECT_EQ((*f)->tensors()[0].name, "a");
  EXPECT_EQ((*f)->tensors()[0].num_elements, 1u);
  float x = 1.0f;
  ASSERT_TRUE((*f)->ReadRange("a", 0, 1, &x, DType::kF32).ok());
  EXPECT_EQ(x, 0.0f);
  Status s = (*f)->ReadRange("b", 0, 1, &x, DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(path), HasSubstr("I32")));
  EXPECT_TRUE((*f)->ReadRange("e", 0, 0, &x, DType::kF32).ok());
}

TEST(SafetensorsFileTest, TruncatedAfterOpenIsDataLossOnRead) {
  testing::TempDir dir;
  Result<SafetensorsLayout> layout =
      SafetensorsLayout::Compute({{"a", SafetensorsDType::kF32, {1000}}});
  ASSERT_TRUE(layout.ok());
  std::string path = dir.file("t.safetensors");
  ASSERT_TRUE(SafetensorsWriter::Create(path, *layout).ok());
  Result<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  std::filesystem::resize_file(path, layout->data_offset() + 400);
  std::vector<float> out(1000);
  Status s = (*f)->ReadRange("a", 0, 1000, out.data(), DType::kF32);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.ToString(), AllOf(HasSubstr(path), HasSubstr("truncated")));
  EXPECT_TRUE((*f)->ReadRange("a", 0, 100, out.data(), DType::kF32).ok());
}

// The format as PyTorch sees it, parsed by hand (the safetensors package is not required).
constexpr const char* kPythonReader = R"PY(
import json, struct, sys
import torch

path = sys.argv[1]
data = open(path, "rb").read()
(n,) = struct.unpack("<Q", data[:8])
assert data[8:9] == b"{", "header must start with '{'"
assert (8 + n) % 8 == 0, "data section not 8-aligned"
header = json.loads(data[8:8 + n].decode("utf-8"))
body = data[8 + n:]
meta = header.pop("__metadata__", {})
assert meta == {"format": "pt"}, meta
dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
spans = sorted(tuple(v["data_offsets"]) for v in header.values())
end = 0
for b, e in spans:
    assert b == end, f"hole or overlap at {b}"
    end = e
assert end == len(body), "data section does not end at end of file"
for name, info in header.items():
    b, e = info["data_offsets"]
    dt = dtypes[info["dtype"]]
    numel = 1
    for d in info["shape"]:
        numel *= d
    if numel == 0:
        continue
    t = torch.frombuffer(bytearray(body[b:e]), dtype=dt).reshape(info["shape"])
    seed = int(sys.argv[2 + list(sorted(header)).index(name)])
    i = torch.arange(numel, dtype=torch.int64)
    want = (((i * 37 + seed * 11) % 101) - 50).to(torch.float32) / 7.0
    want = want.to(dt).reshape(info["shape"])
    if not torch.equal(t, want):
        print(name, "mismatch", t.flatten()[:8], want.flatten()[:8])
        sys.exit(1)
print("ok", len(header))
)PY";

TEST(SafetensorsInteropTest, PyTorchReadsOurFile) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3";
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 has no torch";
  }
  testing::TempDir dir;
  Result<SafetensorsLayout> layout = SafetensorsLayout::Compute(MixedSpecs(), {{"format", "pt"}});
  ASSERT_TRUE(layout.ok());
  const std::string path = dir.file("interop.safetensors");
  Result<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(path, *layout);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  WriteAllFromFloat(**w);
  ASSERT_TRUE((*w)->Finish().ok());
  // The seed of each tensor is its position in data order; pass them in name order.
  std::map<std::string, uint64_t> seeds;
  for (size_t k = 0; k < layout->tensors().size(); ++k)
    seeds[layout->tensors()[k].name] = k;
  const std::string script = dir.file("read.py");
  std::ofstream(script) << kPythonReader;
  std::string command = "/usr/bin/python3 " + script + " " + path;
  for (const auto& [name, seed] : seeds)
    command += " " + std::to_string(seed);
  command += " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr)
    output += buffer;
  int rc = ::pclose(pipe);
  EXPECT_EQ(rc, 0) << output;
  EXPECT_THAT(output, HasSubstr("ok 6"));
}

}  // namespace
}  // namespace strata::train
