// The run-time cuDNN search (cudnn_loader.h), on stand-in libraries: the order of the places
// looked at, the version check, and the errors a user sees. No GPU and no real cuDNN needed.
#include "model/cudnn_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "test_support.h"

namespace strata::model::cudnn {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// `library` copied to dir/libcudnn.so.9 (a file of its own, so the dynamic loader treats it as a
// new object however many tests load the same stand-in).
std::string Install(const fs::path& dir, const char* library) {
  fs::create_directories(dir);
  const fs::path to = dir / kLibraryName;
  fs::copy_file(library, to, fs::copy_options::overwrite_existing);
  return to.string();
}

TEST(CudnnLoaderTest, LooksInTheLoaderTheToolkitAndPythonPackagesInThatOrder) {
  testing::TempDir tmp;
  const fs::path cuda = tmp.path() / "cuda";
  const fs::path site = tmp.path() / "venv/lib/python3.12/site-packages";
  const std::string in_cuda = Install(cuda / "lib64", STRATA_FAKE_CUDNN_NEW);
  const std::string in_site = Install(site / "nvidia/cudnn/lib", STRATA_FAKE_CUDNN_NEW);
  SearchSettings s;
  s.cuda_homes = {(tmp.path() / "no-such-cuda").string(), cuda.string(), cuda.string()};
  s.python_roots = {(tmp.path() / "empty").string(), site.string()};
  const std::vector<Candidate> c = Candidates(s);
  ASSERT_EQ(c.size(), 3u);  // the missing places are left out, the repeated one is tried once
  EXPECT_EQ(c[0].path, kLibraryName);
  EXPECT_THAT(c[0].source, HasSubstr("dynamic loader"));
  EXPECT_EQ(c[1].path, in_cuda);
  EXPECT_THAT(c[1].source, HasSubstr("CUDA toolkit"));
  EXPECT_EQ(c[2].path, in_site);
  EXPECT_THAT(c[2].source, HasSubstr("Python package"));
}

TEST(CudnnLoaderTest, AnExplicitPathIsTheOnlyPlaceLookedAt) {
  testing::TempDir tmp;
  SearchSettings s;
  s.cuda_homes = {(tmp.path() / "cuda").string()};
  Install(tmp.path() / "cuda/lib64", STRATA_FAKE_CUDNN_NEW);
  s.explicit_path = (tmp.path() / "mine").string();
  fs::create_directories(s.explicit_path);
  std::vector<Candidate> c = Candidates(s);
  ASSERT_EQ(c.size(), 1u);  // a directory: its libcudnn.so.9
  EXPECT_EQ(c[0].path, (tmp.path() / "mine" / kLibraryName).string());
  EXPECT_EQ(c[0].source, "STRATA_CUDNN_PATH");
  s.explicit_path = (tmp.path() / "mine/libcudnn.so.9.19.0").string();  // a file: itself
  c = Candidates(s);
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, s.explicit_path);
  // Not there: the load fails and names the setting, instead of finding the toolkit's.
  const Result<Library> lib = LoadFirst(c);
  ASSERT_FALSE(lib.ok());
  EXPECT_THAT(lib.status().message(), HasSubstr("STRATA_CUDNN_PATH"));
  EXPECT_THAT(lib.status().message(), HasSubstr("no such file"));
}

TEST(CudnnLoaderTest, LoadsTheFirstUsableLibraryAndReportsItsVersion) {
  testing::TempDir tmp;
  const std::string old_one = Install(tmp.path() / "old", STRATA_FAKE_CUDNN_OLD);
  const std::string new_one = Install(tmp.path() / "new", STRATA_FAKE_CUDNN_NEW);
  const std::string not_elf = tmp.file("libcudnn.so.9");
  std::ofstream(not_elf) << "not a shared library\n";
  const std::vector<Candidate> c = {{tmp.file("missing/libcudnn.so.9"), "nowhere"},
                                    {not_elf, "a text file"},
                                    {old_one, "an old cuDNN"},
                                    {new_one, "a new cuDNN"}};
  const Result<Library> lib = LoadFirst(c);
  ASSERT_TRUE(lib.ok()) << lib.status().ToString();
  EXPECT_NE(lib->handle, nullptr);
  EXPECT_EQ(lib->version, 91900u);
  EXPECT_EQ(VersionString(lib->version), "9.19.0");
  EXPECT_EQ(lib->path, fs::canonical(new_one).string());
  EXPECT_EQ(lib->source, "a new cuDNN");
}

TEST(CudnnLoaderTest, TheErrorNamesEveryPlaceTriedAndWhyEachFailed) {
  testing::TempDir tmp;
  const std::string old_one = Install(tmp.path() / "old", STRATA_FAKE_CUDNN_OLD);
  const std::string not_elf = tmp.file("libcudnn.so.9");
  std::ofstream(not_elf) << "not a shared library\n";
  const Result<Library> lib = LoadFirst({{tmp.file("missing/libcudnn.so.9"), "nowhere"},
                                         {not_elf, "a text file"},
                                         {old_one, "an old cuDNN"}});
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), StatusCode::kNotFound);
  const std::string m(lib.status().message());
  EXPECT_THAT(m, HasSubstr("missing/libcudnn.so.9 (nowhere): no such file"));
  EXPECT_THAT(m, HasSubstr(not_elf + " (a text file): "));
  EXPECT_THAT(m, HasSubstr("cuDNN 8.9.6, older than the 9.0 Strata needs"));
  EXPECT_THAT(m, HasSubstr("Set STRATA_CUDNN_PATH"));
}

// The real thing, where one is installed (a CUDA toolkit with cuDNN, a PyTorch with its cuDNN
// package): it loads without a GPU, with its sub-libraries, and reports cuDNN 9.
TEST(CudnnLoaderTest, LoadsAnInstalledCudnn) {
  SearchSettings s = SettingsFromEnvironment();
  s.explicit_path.clear();
  std::vector<Candidate> c = Candidates(s);
  c.erase(c.begin());  // only files found on disk, not the loader's own search
  if (c.empty()) GTEST_SKIP() << "no cuDNN 9 installed in the toolkit or a Python package here";
  const Result<Library> lib = LoadFirst(c);
  ASSERT_TRUE(lib.ok()) << lib.status().ToString();
  EXPECT_GE(lib->version, kMinimumVersion);
  std::printf("loaded cuDNN %s from %s (%s)\n", VersionString(lib->version).c_str(),
              lib->path.c_str(), lib->source.c_str());
}

TEST(CudnnLoaderTest, VersionStringsFollowCudnn9sNumbering) {
  EXPECT_EQ(VersionString(90000), "9.0.0");
  EXPECT_EQ(VersionString(92601), "9.26.1");
  EXPECT_EQ(VersionString(91900), "9.19.0");
  EXPECT_EQ(VersionString(8906), "8.9.6");
}

}  // namespace
}  // namespace strata::model::cudnn
