// FileSystem on the local file system: POSIX calls, every result checked and converted by
// ErrnoToStatus; short reads and writes continued, EINTR retried.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

#include "common/errno.h"
#include "strata/file_system.h"

namespace strata {

namespace {

namespace fs = std::filesystem;

// errno is read first: fmt::format may allocate and change it.
Status Failed(const char* call, const std::string& path) {
  const int err = errno;
  return ErrnoToStatus(err, fmt::format("{} {}", call, path));
}

Status FromErrorCode(const std::error_code& ec, const char* call, const std::string& path) {
  return ErrnoToStatus(ec.value(), fmt::format("{} {}", call, path));
}

class LocalFile final : public File {
 public:
  LocalFile(std::string path, int fd, bool append) : path_(std::move(path)), fd_(fd), append_(append) {}
  ~LocalFile() override { ::close(fd_); }

  const std::string& path() const override { return path_; }

  Status ReadAt(uint64_t offset, void* buffer, size_t length) const override {
    char* out = static_cast<char*>(buffer);
    size_t done = 0;
    while (done < length) {
      const ssize_t n = ::pread(fd_, out + done, length - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Failed("read", path_);
      if (n == 0) {
        return DataLossError(fmt::format(
            "{}: unexpected end of file at offset {} (wanted {} bytes at offset {}); the file is "
            "truncated",
            path_, offset + done, length, offset));
      }
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  Status WriteAt(uint64_t offset, const void* data, size_t length) override {
    const char* in = static_cast<const char*>(data);
    size_t done = 0;
    while (done < length) {
      const ssize_t n = append_ ? ::write(fd_, in + done, length - done)
                                : ::pwrite(fd_, in + done, length - done,
                                           static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Failed("write", path_);
      if (n == 0) {
        return DataLossError(fmt::format("write {}: no progress at byte {} of {}", path_, done,
                                         length));
      }
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  Result<uint64_t> Size() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Failed("stat", path_);
    return static_cast<uint64_t>(st.st_size);
  }

  Status Reserve(uint64_t bytes) override {
    // fallocate, not posix_fallocate: glibc's emulation writes every block where the file
    // system cannot, which for a checkpoint is gigabytes; a sparse file is the better fallback.
    if (::fallocate(fd_, 0, 0, static_cast<off_t>(bytes)) == 0) return Status::Ok();
    const int err = errno;
    if (err != EOPNOTSUPP && err != ENOSYS) {
      return ErrnoToStatus(err, fmt::format("reserve {} bytes for {}", bytes, path_));
    }
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return Failed("truncate", path_);
    return Status::Ok();
  }

  Status Sync() override {
    if (::fsync(fd_) != 0) return Failed("fsync", path_);
    return Status::Ok();
  }

 private:
  const std::string path_;
  const int fd_;
  const bool append_;
};

class PosixFileSystem final : public FileSystem {
 public:
  Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode) override {
    int flags = O_CLOEXEC;
    const char* call = "open";
    switch (mode) {
      case OpenMode::kRead:
        flags |= O_RDONLY;
        break;
      case OpenMode::kReadWrite:
        flags |= O_RDWR;
        break;
      case OpenMode::kCreate:
        flags |= O_RDWR | O_CREAT | O_TRUNC;
        call = "create";
        break;
      case OpenMode::kAppend:
        flags |= O_WRONLY | O_CREAT | O_APPEND;
        break;
    }
    const int fd = ::open(path.c_str(), flags, 0644);
    if (fd < 0) return Failed(call, path);
    return std::unique_ptr<File>(new LocalFile(path, fd, mode == OpenMode::kAppend));
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      const int err = errno;
      return ErrnoToStatus(err, fmt::format("rename {} to {}", from, to));
    }
    return Status::Ok();
  }

  Status SyncDir(const std::string& dir) override {
    const std::string d = dir.empty() ? "." : dir;
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Failed("open the directory", d);
    Status st;
    if (::fsync(fd) != 0) st = Failed("fsync the directory", d);
    ::close(fd);
    return st;
  }

  Status CreateDirs(const std::string& dir) override {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) return FromErrorCode(ec, "create the directory", dir);
    return Status::Ok();
  }

  Status RemoveAll(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) return FromErrorCode(ec, "remove", path);
    return Status::Ok();
  }

  Status Symlink(const std::string& target, const std::string& link) override {
    if (::symlink(target.c_str(), link.c_str()) != 0) {
      const int err = errno;
      return ErrnoToStatus(err, fmt::format("symlink {} -> {}", link, target));
    }
    return Status::Ok();
  }

  Result<std::string> ReadLink(const std::string& link) override {
    std::error_code ec;
    const fs::path target = fs::read_symlink(link, ec);
    if (ec) return FromErrorCode(ec, "read the link", link);
    return target.string();
  }

  bool Exists(const std::string& path) override {
    std::error_code ec;
    return fs::exists(path, ec);
  }
  bool IsDirectory(const std::string& path) override {
    std::error_code ec;
    return fs::is_directory(path, ec);
  }
  bool IsSymlink(const std::string& path) override {
    std::error_code ec;
    return fs::is_symlink(fs::symlink_status(path, ec));
  }

  Result<std::vector<std::string>> List(const std::string& dir) override {
    std::error_code ec;
    std::vector<std::string> names;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      names.push_back(it->path().filename().string());
    }
    if (ec) return FromErrorCode(ec, "list", dir);
    std::sort(names.begin(), names.end());
    return names;
  }
};

}  // namespace

FileSystem& LocalFileSystem() {
  static PosixFileSystem* local = new PosixFileSystem();  // never destroyed
  return *local;
}

Result<std::string> ReadFileToString(FileSystem& fs, const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.Open(path, OpenMode::kRead));
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, f->Size());
  std::string text(size, '\0');
  STRATA_RETURN_IF_ERROR(f->ReadAt(0, text.data(), text.size()));
  return text;
}

Status WriteFileDurable(FileSystem& fs, const std::string& path, std::string_view text) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> f, fs.Open(path, OpenMode::kCreate));
  STRATA_RETURN_IF_ERROR(f->WriteAt(0, text.data(), text.size()));
  return f->Sync();
}

Status WriteFileAtomic(FileSystem& fs, const std::string& path, std::string_view text) {
  const std::string tmp = path + ".tmp";
  Status st = WriteFileDurable(fs, tmp, text);
  if (st.ok()) st = fs.Rename(tmp, path);
  if (!st.ok()) {
    (void)fs.RemoveAll(tmp);
    return st;
  }
  return fs.SyncDir(ParentDir(path));
}

std::string ParentDir(const std::string& path) {
  return fs::path(path).parent_path().string();
}

}  // namespace strata
