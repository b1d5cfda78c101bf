// A FileSystem in memory that can crash: the fake of the file seam (strata/file_system.h), after
// RocksDB's FaultInjectionTestFS. It keeps every file's bytes as last written and as last synced,
// and every directory's entries as they are and as they were when the directory was last synced.
// A crash — at the Nth sync point (CrashAfterSyncs), or now (Crash) — makes every later call fail,
// as a process that died there would make none; Restart then shows what a machine would find
// after it: files as of their last Sync, directories as of their last SyncDir (a file created,
// renamed or removed since is back where the last SyncDir of its directory saw it).
//
//   CrashFileSystem fs;
//   fs.CrashAfterSyncs(3);                  // the third Sync / SyncDir is the last that happens
//   Status st = SaveSomething(fs, ...);     // fails with Unavailable at the crash
//   fs.Restart();                           // unsynced bytes and directory changes are gone
//   ... load what is there, through `fs` ...
//
// The model is a tree of nodes, as inodes: a directory holds its entries as they are and as of its
// last SyncDir (what a crash leaves), a file its bytes as written and as of its last Sync. Paths
// are taken lexically ("." and ".." by normalisation); symbolic links are followed in every
// component, as the kernel does; relative paths start at the root. Thread safe: one mutex over
// everything.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "strata/file_system.h"

namespace strata {

class CrashFileSystem final : public FileSystem {
 public:
  CrashFileSystem();
  ~CrashFileSystem() override;

  // The sync points so far (File::Sync and SyncDir calls that succeeded).
  int64_t sync_points() const;
  // Crash right after the sync point that makes sync_points() == n (0: never).
  void CrashAfterSyncs(int64_t n);
  // Crash now.
  void Crash();
  bool crashed() const;
  // After a crash: what survives it, and calls succeed again. The sync count restarts at 0.
  void Restart();

  Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status SyncDir(const std::string& dir) override;
  Status CreateDirs(const std::string& dir) override;
  Status RemoveAll(const std::string& path) override;
  Status Symlink(const std::string& target, const std::string& link) override;
  Result<std::string> ReadLink(const std::string& link) override;
  bool Exists(const std::string& path) override;
  bool IsDirectory(const std::string& path) override;
  bool IsSymlink(const std::string& path) override;
  Result<std::vector<std::string>> List(const std::string& dir) override;

  struct Node;  // a file's bytes (live and synced), a directory, or a link's target

 private:
  class MemFile;

  Status CheckAlive(const std::string& path) const;  // mu_ held
  // The node at `path`, following symbolic links in every component (and in the last when
  // `follow_last`); null when there is none. `parent` / `name` receive the last component's
  // directory and name when that directory exists.
  std::shared_ptr<Node> Lookup(const std::string& path, bool follow_last,
                               std::shared_ptr<Node>* parent = nullptr,
                               std::string* name = nullptr) const;  // mu_ held
  void CountSync();                                                 // mu_ held

  mutable std::mutex mu_;
  std::shared_ptr<Node> root_;  // "/"; relative paths are taken from it too
  int64_t syncs_ = 0;
  int64_t crash_after_ = 0;
  bool crashed_ = false;
};

}  // namespace strata
