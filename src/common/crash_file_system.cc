#include "common/crash_file_system.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

namespace strata {

struct CrashFileSystem::Node {
  enum class Kind { kFile, kDir, kLink } kind = Kind::kFile;
  std::string data;    // a file's bytes now
  std::string synced;  // ... as of its last Sync
  std::string target;  // a link's
  std::map<std::string, std::shared_ptr<Node>> entries;  // a directory's now
  std::map<std::string, std::shared_ptr<Node>> durable;  // ... as of its last SyncDir
};

namespace {

using Node = CrashFileSystem::Node;

std::shared_ptr<Node> NewNode(Node::Kind kind, std::string target = {}) {
  auto n = std::make_shared<Node>();
  n->kind = kind;
  n->target = std::move(target);
  return n;
}

// The components of `path`, normalised ("a/./b/../c" -> {"a", "c"}).
std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> names;
  for (const auto& part : std::filesystem::path(path).lexically_normal()) {
    const std::string s = part.string();
    if (s.empty() || s == "/" || s == ".") continue;
    if (s == "..") {
      if (!names.empty()) names.pop_back();
      continue;
    }
    names.push_back(s);
  }
  return names;
}

std::string JoinNames(const std::vector<std::string>& names, size_t end) {
  std::string p;
  for (size_t i = 0; i < end; ++i) p += "/" + names[i];
  return p.empty() ? "/" : p;
}

// What a crash leaves of `node`: a file's synced bytes, a directory's durable entries (each as
// what a crash leaves of it).
std::shared_ptr<Node> Survivor(const std::shared_ptr<Node>& node) {
  auto copy = NewNode(node->kind, node->target);
  copy->data = copy->synced = node->synced;
  for (const auto& [name, child] : node->durable) copy->entries[name] = Survivor(child);
  copy->durable = copy->entries;
  return copy;
}

Status NoSuch(const char* call, const std::string& path) {
  return NotFoundError(fmt::format("{} {}: No such file or directory (ENOENT)", call, path));
}

}  // namespace

// A handle on a file node: it keeps the node when the name is renamed or removed, as a file
// descriptor keeps the inode.
class CrashFileSystem::MemFile final : public File {
 public:
  MemFile(CrashFileSystem* fs, std::string path, std::shared_ptr<Node> node, OpenMode mode)
      : fs_(fs), path_(std::move(path)), node_(std::move(node)), mode_(mode) {}

  const std::string& path() const override { return path_; }

  Status ReadAt(uint64_t offset, void* buffer, size_t length) const override {
    std::lock_guard<std::mutex> lock(fs_->mu_);
    STRATA_RETURN_IF_ERROR(fs_->CheckAlive(path_));
    if (mode_ == OpenMode::kAppend) {
      return PermissionDeniedError(fmt::format("read {}: opened for appending", path_));
    }
    if (offset + length > node_->data.size()) {
      return DataLossError(fmt::format(
          "{}: unexpected end of file at offset {} (wanted {} bytes at offset {}); the file is "
          "truncated",
          path_, node_->data.size(), length, offset));
    }
    if (length > 0) std::memcpy(buffer, node_->data.data() + offset, length);
    return Status::Ok();
  }

  Status WriteAt(uint64_t offset, const void* data, size_t length) override {
    std::lock_guard<std::mutex> lock(fs_->mu_);
    STRATA_RETURN_IF_ERROR(fs_->CheckAlive(path_));
    if (mode_ == OpenMode::kRead) {
      return PermissionDeniedError(fmt::format("write {}: opened read-only", path_));
    }
    std::string& bytes = node_->data;
    if (mode_ == OpenMode::kAppend) offset = bytes.size();
    if (offset + length > bytes.size()) bytes.resize(offset + length, '\0');
    if (length > 0) std::memcpy(bytes.data() + offset, data, length);
    return Status::Ok();
  }

  Result<uint64_t> Size() const override {
    std::lock_guard<std::mutex> lock(fs_->mu_);
    STRATA_RETURN_IF_ERROR(fs_->CheckAlive(path_));
    return static_cast<uint64_t>(node_->data.size());
  }

  Status Reserve(uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(fs_->mu_);
    STRATA_RETURN_IF_ERROR(fs_->CheckAlive(path_));
    if (bytes > node_->data.size()) node_->data.resize(bytes, '\0');
    return Status::Ok();
  }

  Status Sync() override {
    std::lock_guard<std::mutex> lock(fs_->mu_);
    STRATA_RETURN_IF_ERROR(fs_->CheckAlive(path_));
    node_->synced = node_->data;
    fs_->CountSync();
    return Status::Ok();
  }

 private:
  CrashFileSystem* fs_;
  const std::string path_;
  const std::shared_ptr<Node> node_;
  const OpenMode mode_;
};

CrashFileSystem::CrashFileSystem() : root_(NewNode(Node::Kind::kDir)) {}
CrashFileSystem::~CrashFileSystem() = default;

int64_t CrashFileSystem::sync_points() const {
  std::lock_guard<std::mutex> lock(mu_);
  return syncs_;
}

void CrashFileSystem::CrashAfterSyncs(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  crash_after_ = n;
}

void CrashFileSystem::Crash() {
  std::lock_guard<std::mutex> lock(mu_);
  crashed_ = true;
}

bool CrashFileSystem::crashed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return crashed_;
}

void CrashFileSystem::Restart() {
  std::lock_guard<std::mutex> lock(mu_);
  // New nodes: handles still open on the old ones see nothing of the new world.
  root_ = Survivor(root_);
  syncs_ = 0;
  crash_after_ = 0;
  crashed_ = false;
}

void CrashFileSystem::CountSync() {
  ++syncs_;
  if (crash_after_ > 0 && syncs_ == crash_after_) crashed_ = true;
}

Status CrashFileSystem::CheckAlive(const std::string& path) const {
  if (!crashed_) return Status::Ok();
  return UnavailableError(fmt::format("{}: the file system has crashed (simulated)", path));
}

std::shared_ptr<Node> CrashFileSystem::Lookup(const std::string& path, bool follow_last,
                                              std::shared_ptr<Node>* parent,
                                              std::string* name) const {
  std::vector<std::string> names = Components(path);
  std::shared_ptr<Node> dir = root_;
  for (size_t i = 0, hops = 0; i < names.size();) {
    const bool last = i + 1 == names.size();
    if (last) {
      if (parent) *parent = dir;
      if (name) *name = names[i];
    }
    auto it = dir->entries.find(names[i]);
    if (it == dir->entries.end()) return nullptr;
    const std::shared_ptr<Node>& node = it->second;
    if (node->kind == Node::Kind::kLink && (!last || follow_last)) {
      if (++hops > 40) return nullptr;
      // Continue from the target, then the rest of the path.
      const std::string base = node->target.front() == '/' ? node->target
                                                           : JoinNames(names, i) + "/" + node->target;
      std::vector<std::string> rest = Components(base);
      rest.insert(rest.end(), names.begin() + static_cast<std::ptrdiff_t>(i) + 1, names.end());
      names = std::move(rest);
      dir = root_;
      i = 0;
      continue;
    }
    if (last) return node;
    if (node->kind != Node::Kind::kDir) return nullptr;
    dir = node;
    ++i;
  }
  return root_;  // the path names the root
}

Result<std::unique_ptr<File>> CrashFileSystem::Open(const std::string& path, OpenMode mode) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(path));
  std::shared_ptr<Node> parent;
  std::string name;
  auto node = Lookup(path, true, &parent, &name);
  if (node && node->kind == Node::Kind::kDir) {
    return InvalidArgumentError(fmt::format("open {}: Is a directory (EISDIR)", path));
  }
  if (!node) {
    if (mode == OpenMode::kRead || mode == OpenMode::kReadWrite || !parent ||
        parent->kind != Node::Kind::kDir) {
      return NoSuch("open", path);
    }
    node = NewNode(Node::Kind::kFile);
    parent->entries[name] = node;
  } else if (mode == OpenMode::kCreate) {
    node->data.clear();
  }
  return std::unique_ptr<File>(new MemFile(this, path, node, mode));
}

Status CrashFileSystem::Rename(const std::string& from, const std::string& to) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(from));
  std::shared_ptr<Node> src_dir, dst_dir;
  std::string src_name, dst_name;
  const auto node = Lookup(from, false, &src_dir, &src_name);
  if (!node || node == root_) return NoSuch("rename", from);
  const auto old = Lookup(to, false, &dst_dir, &dst_name);
  if (!dst_dir) return NoSuch("rename to", to);
  if (old == node) return Status::Ok();
  if (old && old->kind == Node::Kind::kDir && !old->entries.empty()) {
    return FailedPreconditionError(fmt::format(
        "rename {} to {}: Directory not empty (ENOTEMPTY)", from, to));
  }
  src_dir->entries.erase(src_name);
  dst_dir->entries[dst_name] = node;
  return Status::Ok();
}

Status CrashFileSystem::SyncDir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(dir));
  const auto node = Lookup(dir.empty() ? "/" : dir, true);
  if (!node || node->kind != Node::Kind::kDir) return NoSuch("open the directory", dir);
  node->durable = node->entries;
  CountSync();
  return Status::Ok();
}

Status CrashFileSystem::CreateDirs(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(dir));
  const std::vector<std::string> names = Components(dir);
  for (size_t i = 1; i <= names.size(); ++i) {
    const std::string prefix = JoinNames(names, i);
    std::shared_ptr<Node> parent;
    std::string name;
    const auto node = Lookup(prefix, true, &parent, &name);
    if (node) {
      if (node->kind != Node::Kind::kDir) {
        return FailedPreconditionError(
            fmt::format("create the directory {}: {} is not a directory", dir, prefix));
      }
      continue;
    }
    if (!parent) return NoSuch("create the directory", prefix);
    parent->entries[name] = NewNode(Node::Kind::kDir);
  }
  return Status::Ok();
}

Status CrashFileSystem::RemoveAll(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(path));
  std::shared_ptr<Node> parent;
  std::string name;
  const auto node = Lookup(path, false, &parent, &name);
  if (node && parent) parent->entries.erase(name);
  return Status::Ok();
}

Status CrashFileSystem::Symlink(const std::string& target, const std::string& link) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(link));
  std::shared_ptr<Node> parent;
  std::string name;
  if (Lookup(link, false, &parent, &name)) {
    return AlreadyExistsError(fmt::format("symlink {}: File exists (EEXIST)", link));
  }
  if (!parent) return NoSuch("symlink", link);
  parent->entries[name] = NewNode(Node::Kind::kLink, target);
  return Status::Ok();
}

Result<std::string> CrashFileSystem::ReadLink(const std::string& link) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(link));
  const auto node = Lookup(link, false);
  if (!node || node->kind != Node::Kind::kLink) {
    return NotFoundError(fmt::format("read the link {}: not a symbolic link", link));
  }
  return node->target;
}

bool CrashFileSystem::Exists(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  return !crashed_ && Lookup(path, true) != nullptr;
}

bool CrashFileSystem::IsDirectory(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto node = crashed_ ? nullptr : Lookup(path, true);
  return node && node->kind == Node::Kind::kDir;
}

bool CrashFileSystem::IsSymlink(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto node = crashed_ ? nullptr : Lookup(path, false);
  return node && node->kind == Node::Kind::kLink;
}

Result<std::vector<std::string>> CrashFileSystem::List(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  STRATA_RETURN_IF_ERROR(CheckAlive(dir));
  const auto node = Lookup(dir.empty() ? "/" : dir, true);
  if (!node || node->kind != Node::Kind::kDir) return NoSuch("list", dir);
  std::vector<std::string> names;
  for (const auto& [name, child] : node->entries) names.push_back(name);
  return names;
}

}  // namespace strata
