// The file seam (strata/file_system.h): one contract for the local file system and for the
// crash-simulating one, then what a crash keeps and drops.
#include "strata/file_system.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "common/crash_file_system.h"
#include "test_support.h"

namespace strata {
namespace {

// The contract, for each implementation. Paths are under a fresh directory `root_`.
class FileSystemContractTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (std::string(GetParam()) == "local") {
      fs_ = &LocalFileSystem();
      root_ = dir_.path().string();
    } else {
      crash_ = std::make_unique<CrashFileSystem>();
      fs_ = crash_.get();
      root_ = "/work";
      ASSERT_TRUE(fs_->CreateDirs(root_).ok());
    }
  }
  std::string P(const std::string& name) const { return root_ + "/" + name; }

  testing::TempDir dir_;
  std::unique_ptr<CrashFileSystem> crash_;
  FileSystem* fs_ = nullptr;
  std::string root_;
};

TEST_P(FileSystemContractTest, WritesReadBackExactly) {
  auto f = fs_->Open(P("a.bin"), OpenMode::kCreate);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_TRUE((*f)->WriteAt(0, "hello", 5).ok());
  ASSERT_TRUE((*f)->WriteAt(8, "xyz", 3).ok());  // past the end: the gap reads as zeros
  ASSERT_TRUE((*f)->Sync().ok());
  EXPECT_EQ(*(*f)->Size(), 11u);
  char buf[11];
  ASSERT_TRUE((*f)->ReadAt(0, buf, 11).ok());
  EXPECT_EQ(std::string(buf, 11), std::string("hello\0\0\0xyz", 11));
  // Reading past the end is DataLoss naming the file.
  const Status past = (*f)->ReadAt(9, buf, 4);
  EXPECT_EQ(past.code(), StatusCode::kDataLoss);
  EXPECT_NE(past.message().find("a.bin"), std::string::npos) << past.ToString();
  // kCreate truncates; Reserve extends with zeros.
  auto again = fs_->Open(P("a.bin"), OpenMode::kCreate);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*(*again)->Size(), 0u);
  ASSERT_TRUE((*again)->Reserve(4096).ok());
  EXPECT_EQ(*(*again)->Size(), 4096u);
}

TEST_P(FileSystemContractTest, AppendGoesAtTheEnd) {
  ASSERT_TRUE(WriteFileDurable(*fs_, P("log"), "one\n").ok());
  auto f = fs_->Open(P("log"), OpenMode::kAppend);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE((*f)->WriteAt(0, "two\n", 4).ok());
  EXPECT_EQ(*ReadFileToString(*fs_, P("log")), "one\ntwo\n");
}

TEST_P(FileSystemContractTest, MissingFilesAreNotFoundNamingThePath) {
  auto f = fs_->Open(P("nope"), OpenMode::kRead);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("nope"), std::string::npos) << f.status().ToString();
  EXPECT_FALSE(fs_->Open(P("no/dir/x"), OpenMode::kCreate).ok());
  EXPECT_FALSE(fs_->Exists(P("nope")));
}

TEST_P(FileSystemContractTest, DirectoriesRenamesAndLinks) {
  ASSERT_TRUE(fs_->CreateDirs(P("d/e/f")).ok());
  ASSERT_TRUE(fs_->CreateDirs(P("d/e")).ok());  // existing: fine
  EXPECT_TRUE(fs_->IsDirectory(P("d/e/f")));
  ASSERT_TRUE(WriteFileAtomic(*fs_, P("d/e/f/x.json"), "{}").ok());
  EXPECT_FALSE(fs_->Exists(P("d/e/f/x.json.tmp")));
  // A directory moves with its contents.
  ASSERT_TRUE(fs_->Rename(P("d/e/f"), P("d/g")).ok());
  EXPECT_EQ(*ReadFileToString(*fs_, P("d/g/x.json")), "{}");
  EXPECT_FALSE(fs_->Exists(P("d/e/f")));
  // A link, followed in the middle of a path, replaced atomically by a rename.
  ASSERT_TRUE(fs_->Symlink("g", P("d/latest")).ok());
  EXPECT_TRUE(fs_->IsSymlink(P("d/latest")));
  EXPECT_FALSE(fs_->IsSymlink(P("d/g")));
  EXPECT_EQ(*fs_->ReadLink(P("d/latest")), "g");
  EXPECT_EQ(*ReadFileToString(*fs_, P("d/latest/x.json")), "{}");
  EXPECT_EQ(fs_->Symlink("g", P("d/latest")).code(), StatusCode::kAlreadyExists);
  ASSERT_TRUE(fs_->CreateDirs(P("d/h")).ok());
  ASSERT_TRUE(fs_->Symlink("h", P("d/latest.tmp")).ok());
  ASSERT_TRUE(fs_->Rename(P("d/latest.tmp"), P("d/latest")).ok());
  EXPECT_EQ(*fs_->ReadLink(P("d/latest")), "h");
  EXPECT_EQ(*fs_->List(P("d")), (std::vector<std::string>{"e", "g", "h", "latest"}));
  // RemoveAll takes trees, and missing paths are fine.
  ASSERT_TRUE(fs_->RemoveAll(P("d/g")).ok());
  ASSERT_TRUE(fs_->RemoveAll(P("d/g")).ok());
  EXPECT_FALSE(fs_->Exists(P("d/g/x.json")));
  ASSERT_TRUE(fs_->SyncDir(P("d")).ok());
}

TEST_P(FileSystemContractTest, AnOpenFileKeepsItsBytesAfterARename) {
  auto f = fs_->Open(P("old"), OpenMode::kCreate);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(fs_->Rename(P("old"), P("new")).ok());
  ASSERT_TRUE((*f)->WriteAt(0, "abc", 3).ok());
  EXPECT_EQ(*ReadFileToString(*fs_, P("new")), "abc");
}

INSTANTIATE_TEST_SUITE_P(Backends, FileSystemContractTest, ::testing::Values("local", "crash"),
                         [](const auto& param_info) { return std::string(param_info.param); });

// What a crash keeps: synced bytes, and directory entries whose directory was synced.
TEST(CrashFileSystemTest, ACrashDropsWhatWasNotSynced) {
  CrashFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/d").ok());
  ASSERT_TRUE(fs.SyncDir("/").ok());
  ASSERT_TRUE(WriteFileDurable(fs, "/d/synced", "kept").ok());  // bytes synced, entry not yet
  ASSERT_TRUE(fs.SyncDir("/d").ok());
  {
    auto f = fs.Open("/d/synced", OpenMode::kReadWrite);
    ASSERT_TRUE((*f)->WriteAt(4, "+lost", 5).ok());  // never synced
  }
  {
    auto f = fs.Open("/d/unsynced", OpenMode::kCreate);  // its entry is never made durable
    ASSERT_TRUE((*f)->WriteAt(0, "x", 1).ok());
    ASSERT_TRUE((*f)->Sync().ok());
  }
  EXPECT_EQ(*ReadFileToString(fs, "/d/synced"), "kept+lost");
  fs.Crash();
  EXPECT_EQ(fs.Open("/d/synced", OpenMode::kRead).status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(fs.Exists("/d/synced"));
  fs.Restart();
  EXPECT_EQ(*ReadFileToString(fs, "/d/synced"), "kept");
  EXPECT_FALSE(fs.Exists("/d/unsynced"));
}

TEST(CrashFileSystemTest, RenamesAndRemovalsLastOnlyOnceTheDirectoryIsSynced) {
  CrashFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/d").ok());
  ASSERT_TRUE(fs.SyncDir("/").ok());
  ASSERT_TRUE(WriteFileAtomic(fs, "/d/a", "A").ok());
  ASSERT_TRUE(WriteFileAtomic(fs, "/d/b", "B").ok());
  ASSERT_TRUE(fs.Rename("/d/a", "/d/c").ok());
  ASSERT_TRUE(fs.RemoveAll("/d/b").ok());
  fs.Crash();
  fs.Restart();
  // Neither the rename nor the removal was synced: the old names are back.
  EXPECT_EQ(*ReadFileToString(fs, "/d/a"), "A");
  EXPECT_EQ(*ReadFileToString(fs, "/d/b"), "B");
  EXPECT_FALSE(fs.Exists("/d/c"));
  ASSERT_TRUE(fs.Rename("/d/a", "/d/c").ok());
  ASSERT_TRUE(fs.SyncDir("/d").ok());
  fs.Crash();
  fs.Restart();
  EXPECT_FALSE(fs.Exists("/d/a"));
  EXPECT_EQ(*ReadFileToString(fs, "/d/c"), "A");
}

// A directory renamed into place carries what its own SyncDir made durable, as an inode does;
// a directory never synced into its parent is gone with everything in it.
TEST(CrashFileSystemTest, ADirectoryCarriesItsDurableEntriesAcrossARename) {
  CrashFileSystem fs;
  ASSERT_TRUE(fs.CreateDirs("/save/.tmp").ok());
  ASSERT_TRUE(fs.SyncDir("/").ok());
  ASSERT_TRUE(WriteFileDurable(fs, "/save/.tmp/x", "X").ok());
  ASSERT_TRUE(fs.SyncDir("/save/.tmp").ok());
  ASSERT_TRUE(fs.Rename("/save/.tmp", "/save/step").ok());
  fs.Crash();
  fs.Restart();
  // "/save" was synced into "/", but the rename in "/save" was not synced: neither name is there.
  EXPECT_TRUE(fs.IsDirectory("/save"));
  EXPECT_FALSE(fs.Exists("/save/step"));
  EXPECT_FALSE(fs.Exists("/save/.tmp"));
  ASSERT_TRUE(fs.CreateDirs("/save/.tmp").ok());
  ASSERT_TRUE(WriteFileDurable(fs, "/save/.tmp/x", "X").ok());
  ASSERT_TRUE(fs.SyncDir("/save/.tmp").ok());
  ASSERT_TRUE(fs.Rename("/save/.tmp", "/save/step").ok());
  ASSERT_TRUE(fs.SyncDir("/save").ok());
  fs.Crash();
  fs.Restart();
  EXPECT_EQ(*ReadFileToString(fs, "/save/step/x"), "X");
  EXPECT_FALSE(fs.Exists("/save/.tmp"));
}

TEST(CrashFileSystemTest, CrashAfterTheNthSyncPoint) {
  CrashFileSystem fs;
  fs.CrashAfterSyncs(2);
  ASSERT_TRUE(fs.CreateDirs("/d").ok());
  ASSERT_TRUE(fs.SyncDir("/").ok());                       // 1
  ASSERT_TRUE(WriteFileDurable(fs, "/d/a", "A").ok());     // 2: the crash follows it
  EXPECT_TRUE(fs.crashed());
  const Status after = fs.SyncDir("/d");
  EXPECT_EQ(after.code(), StatusCode::kUnavailable);
  EXPECT_NE(after.message().find("crashed"), std::string::npos);
  EXPECT_EQ(fs.sync_points(), 2);
  fs.Restart();
  EXPECT_TRUE(fs.IsDirectory("/d"));
  EXPECT_FALSE(fs.Exists("/d/a"));  // its bytes were synced, its entry was not
  EXPECT_EQ(fs.sync_points(), 0);
}

}  // namespace
}  // namespace strata
