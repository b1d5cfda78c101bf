#include "test_support.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>

namespace strata::testing {

namespace {
std::filesystem::path TestRoot() {
  const char* env = std::getenv("STRATA_TEST_DIR");
  if (env != nullptr && *env != '\0') return env;
  return STRATA_TEST_TMP_DIR;
}
}  // namespace

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "test";
  for (char& c : name) {
    if (c == '/' || c == ' ') c = '_';
  }
  path_ = TestRoot() /
          (name + "." + std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1)));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  // Restore permissions a test may have removed, so the tree can be deleted.
  for (auto it = std::filesystem::recursive_directory_iterator(
           path_, std::filesystem::directory_options::skip_permission_denied, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    std::filesystem::permissions(it->path(), std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ec);
  }
  std::filesystem::remove_all(path_, ec);
}

void FillPattern(void* buffer, size_t length, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + 1);
  auto* out = static_cast<unsigned char*>(buffer);
  size_t i = 0;
  for (; i + 8 <= length; i += 8) {
    uint64_t v = rng();
    std::memcpy(out + i, &v, 8);
  }
  uint64_t v = rng();
  for (; i < length; ++i) {
    out[i] = static_cast<unsigned char>(v);
    v >>= 8;
  }
}

std::vector<char> PatternBytes(size_t length, uint64_t seed) {
  std::vector<char> out(length);
  FillPattern(out.data(), length, seed);
  return out;
}

std::vector<char> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::filesystem::path SourceDir() {
  return STRATA_SOURCE_DIR;
}

bool IsRoot() {
  return geteuid() == 0;
}

std::vector<float> RandomVector(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v)
    x = dist(rng) * scale;
  return v;
}

std::vector<int32_t> RandomTokens(size_t n, int32_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v)
    x = dist(rng);
  return v;
}

}  // namespace strata::testing
