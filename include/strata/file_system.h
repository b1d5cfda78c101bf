// The file seam: every file Strata reads or writes outside io/ (token data, safetensors,
// checkpoints, manifests, traces, monitors, reports) goes through a FileSystem, as every block
// of offloaded state goes through a BlockStore. The production one is the local file system
// (LocalFileSystem); tests use CrashFileSystem (common/crash_file_system.h), which keeps files in
// memory and, on a simulated crash, drops every byte and every directory change that was not
// synced — so that crash safety is tested at every sync point without killing a process.
//
//   FileSystem& fs = LocalFileSystem();
//   STRATA_ASSIGN_OR_RETURN(auto f, fs.Open(path, OpenMode::kCreate));
//   STRATA_RETURN_IF_ERROR(f->WriteAt(0, data, size));
//   STRATA_RETURN_IF_ERROR(f->Sync());          // the file's bytes and size are durable
//   STRATA_RETURN_IF_ERROR(fs.Rename(tmp, path));
//   STRATA_RETURN_IF_ERROR(fs.SyncDir(dir));    // the rename is durable
//
// Durability (the contract CrashFileSystem enforces): a file's bytes survive a crash once its
// File::Sync returns; a directory entry (a created file or directory, a rename, a symbolic link,
// a removal) survives once SyncDir of the directory that holds it returns. Rename replaces its
// target atomically: after a crash either the old or the new entry is there.
//
// Errors: every OS failure becomes a Status in one place (common/errno.h), naming the call and
// the path ("write /ckpt/model.safetensors: No space left on device (ENOSPC)"). ReadAt of bytes
// past the end of a file is DataLoss naming the file, the offset and the length.
//
// Thread safety: a FileSystem may be called from any number of threads. A File's ReadAt and
// WriteAt may be called from several threads at once for disjoint ranges; Sync, Reserve and the
// destructor must not overlap other calls on the same File.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace strata {

enum class OpenMode {
  kRead,       // an existing file, read only
  kReadWrite,  // an existing file
  kCreate,     // created, or truncated to 0 bytes when it exists
  kAppend,     // created when missing; WriteAt offsets are ignored: every write goes at the end
};

class File {
 public:
  virtual ~File() = default;  // closes; nothing is synced
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  virtual const std::string& path() const = 0;
  // Exactly `length` bytes at `offset`: DataLoss when the file ends before them.
  virtual Status ReadAt(uint64_t offset, void* buffer, size_t length) const = 0;
  // Exactly `length` bytes at `offset` (at the end for kAppend), growing the file as needed.
  virtual Status WriteAt(uint64_t offset, const void* data, size_t length) = 0;
  virtual Result<uint64_t> Size() const = 0;
  // Makes the file `bytes` long, reserving its blocks where the file system can (fallocate;
  // else a sparse extension). Unwritten bytes read as zeros.
  virtual Status Reserve(uint64_t bytes) = 0;
  // Makes the file's bytes and size durable.
  virtual Status Sync() = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;

  virtual Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode) = 0;
  // Moves `from` over `to` (a file, a directory, or a symbolic link), replacing `to` atomically
  // when it is a file or a link.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Makes the entries of directory `dir` durable ("" is the current directory).
  virtual Status SyncDir(const std::string& dir) = 0;
  // Creates `dir` and its missing parents (existing ones are fine).
  virtual Status CreateDirs(const std::string& dir) = 0;
  // Removes a file, a link or a directory tree; a missing path is fine.
  virtual Status RemoveAll(const std::string& path) = 0;
  // A symbolic link at `link` to `target` (relative to the link's directory, or absolute).
  virtual Status Symlink(const std::string& target, const std::string& link) = 0;
  // A link's target, as stored. NotFound when `link` is not a symbolic link.
  virtual Result<std::string> ReadLink(const std::string& link) = 0;
  // Whether `path` exists (following links) / is a directory / is a symbolic link.
  virtual bool Exists(const std::string& path) = 0;
  virtual bool IsDirectory(const std::string& path) = 0;
  virtual bool IsSymlink(const std::string& path) = 0;
  // The names in directory `dir`, sorted. NotFound when it does not exist.
  virtual Result<std::vector<std::string>> List(const std::string& dir) = 0;
};

// The local file system (POSIX calls; O_CLOEXEC on every descriptor).
FileSystem& LocalFileSystem();

// ---- helpers on any FileSystem --------------------------------------------------------------

// The whole file as text.
Result<std::string> ReadFileToString(FileSystem& fs, const std::string& path);
// Creates (or truncates) `path`, writes `text` and syncs it. The file may hold part of `text`
// after an error, so callers that must not lose the previous version use WriteFileAtomic.
Status WriteFileDurable(FileSystem& fs, const std::string& path, std::string_view text);
// `text` becomes `path`'s content atomically and durably: written to a temporary name beside it,
// synced, renamed over `path`, and the directory synced. After a crash `path` holds either its
// old content or `text`, complete.
Status WriteFileAtomic(FileSystem& fs, const std::string& path, std::string_view text);
// The directory part of `path` ("" for a bare name), as SyncDir takes it.
std::string ParentDir(const std::string& path);

}  // namespace strata
