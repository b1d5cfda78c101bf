#include "offload/nvme_layout.h"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <utility>

#include "common/file_lock.h"
#include "common/log.h"
#include "common/units.h"

namespace strata::offload {

Result<std::unique_ptr<NvmeLayout>> NvmeLayout::Create(io::BlockStore& store,
                                                       const NvmeLayoutOptions& options,
                                                       std::span<const NvmeLayoutEntry> entries) {
  if (options.paths.empty()) {
    return Status(StatusCode::kInvalidArgument,
                  "NVMe offload needs at least one directory (strata.io.nvme_paths or the "
                  "offload sections' nvme_path)");
  }
  if (options.stripe_unit == 0 || options.stripe_unit % io::kDirectIoAlignment != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "NVMe stripe unit " + std::to_string(options.stripe_unit) +
                      " is not a positive multiple of 4096");
  }
  std::unique_ptr<NvmeLayout> layout(new NvmeLayout(store, options));

  // Slots per class, in registration order.
  std::map<std::string, uint64_t> class_bytes;  // ordered: file order is stable
  std::vector<std::pair<std::string, NvmeLayoutEntry>> pending;
  for (const NvmeLayoutEntry& e : entries) {
    if (e.bytes == 0) {
      return Status(StatusCode::kInvalidArgument,
                    "NVMe shard " + std::to_string(e.id) + " has 0 bytes");
    }
    std::string cls = e.state_class.empty() ? "param" : e.state_class;
    uint64_t& end = class_bytes[cls];
    NvmeSlot slot;
    slot.offset = end;
    slot.length = RoundUp(e.bytes, io::kDirectIoAlignment);
    end += slot.length;
    if (!layout->slots_.emplace(e.id, slot).second) {
      return Status(StatusCode::kInvalidArgument,
                    "NVMe shard " + std::to_string(e.id) + " is registered twice");
    }
    pending.emplace_back(cls, e);
  }

  std::map<std::string, io::FileId> file_of_class;
  for (const auto& [cls, bytes] : class_bytes) {
    io::FileSpec spec;
    for (const std::string& dir : options.paths) {
      spec.paths.push_back(dir + "/" + options.prefix + ".rank" + std::to_string(options.rank) +
                           "." + cls + ".swap");
    }
    spec.stripe_unit = options.stripe_unit;
    spec.direct = options.direct;
    spec.create = true;
    spec.truncate = true;
    spec.preallocate = bytes;
    spec.durable_writes = options.durable_writes;
    // One run per file: a second run on the same paths (and prefix) is refused here, before
    // Open truncates what the first one is using. (A directory that does not exist has nothing
    // to protect; Open reports it. The memory store's paths are such.)
    for (const std::string& p : spec.paths) {
      if (!std::filesystem::is_directory(std::filesystem::path(p).parent_path())) continue;
      Result<FileLock> lock = FileLock::Acquire(p, "NVMe offload file");
      if (!lock.ok()) return lock.status();
      layout->locks_.push_back(std::move(*lock));
    }
    Result<io::FileId> file = store.Open(spec);
    if (!file.ok()) {
      return file.status().WithContext("creating the NVMe offload file for '" + cls + "' state");
    }
    layout->files_.push_back(*file);
    layout->file_paths_.push_back(spec.paths);
    file_of_class[cls] = *file;
    layout->total_bytes_ += bytes;
    Result<io::FileInfo> info = store.Info(*file);
    if (info.ok()) layout->direct_ = info->direct;
    STRATA_LOG(debug, offload, "NVMe file for '{}' state: {} over {} path(s), {} ({} B)", cls,
               spec.paths.front(), spec.paths.size(), FormatBytes(bytes), bytes);
  }
  for (const auto& [cls, e] : pending) layout->slots_[e.id].file = file_of_class[cls];
  return layout;
}

NvmeLayout::~NvmeLayout() {
  for (size_t i = 0; i < files_.size(); ++i) {
    Status st = store_.Close(files_[i]);
    if (!st.ok()) {
      STRATA_LOG(warn, offload, "closing NVMe offload file {}: {}", file_paths_[i].front(),
                 st.ToString());
      continue;  // still in use: leave it rather than unlink under live I/O
    }
    if (!options_.keep_files) {
      for (const std::string& p : file_paths_[i]) ::unlink(p.c_str());
    }
  }
}

const NvmeSlot* NvmeLayout::Find(uint64_t id) const {
  auto it = slots_.find(id);
  return it == slots_.end() ? nullptr : &it->second;
}

}  // namespace strata::offload
