// Helpers shared by the test suites.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace strata::testing {

// A fresh directory for one test, removed (with its contents) when the object is destroyed.
// It lives under $STRATA_TEST_DIR if set, else under the build tree's test-tmp/ (a real disk, so
// O_DIRECT works; /tmp may be tmpfs).
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// Deterministic pseudo-random bytes (a function of seed and position).
void FillPattern(void* buffer, size_t length, uint64_t seed);
std::vector<char> PatternBytes(size_t length, uint64_t seed);

// n floats drawn from N(0, scale^2), and n token ids uniform in [0, vocab), from `seed`.
std::vector<float> RandomVector(size_t n, uint64_t seed, float scale = 1.0f);
std::vector<int32_t> RandomTokens(size_t n, int32_t vocab, uint64_t seed);

// Reads a whole file into memory (for checking what a store wrote).
std::vector<char> ReadWholeFile(const std::string& path);

// The project's source directory (for docs/examples and the like).
std::filesystem::path SourceDir();

// True when running as root (some permission tests need another approach there).
bool IsRoot();

}  // namespace strata::testing
