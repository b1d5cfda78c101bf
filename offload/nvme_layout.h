// NvmeLayout: where NVMe-homed shards live on disk.
//
// One file per (rank, state class) — e.g. "strata.rank0.param.swap" and
// "strata.rank0.optim.swap" — created in every configured directory and striped over them
// (BlockStore striping, RAID-0 style, `stripe_unit` bytes per directory in turn), so a run with
// several NVMe drives reads and writes all of them at once. Each shard gets a slot at a 4 KiB
// aligned offset, its length rounded up to 4 KiB, in registration order: one shard is one aligned
// O_DIRECT request. The files are preallocated (fallocate) for the whole layout at creation, so a
// full disk is reported before training starts (naming the path, the bytes needed and free), and
// removed when the layout is destroyed unless `keep_files` is set (offload files are scratch: a
// checkpoint is the durable copy). Each file is locked (common/file_lock.h) from before it is
// opened until after it is removed: a second run on the same paths is refused, naming the holder.
//
// Threading: immutable after Create; Find may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/file_lock.h"
#include "strata/block_store.h"
#include "strata/status.h"

namespace strata::offload {

struct NvmeLayoutOptions {
  std::vector<std::string> paths;   // directories (one per drive); must exist
  uint64_t stripe_unit = 1 << 20;   // multiple of 4096
  int rank = 0;
  std::string prefix = "strata";    // file names: <prefix>.rank<r>.<class>.swap
  io::DirectMode direct = io::DirectMode::kAuto;
  bool durable_writes = false;
  bool keep_files = false;
};

struct NvmeSlot {
  io::FileId file = 0;
  uint64_t offset = 0;  // 4 KiB aligned
  uint64_t length = 0;  // the shard's bytes rounded up to 4 KiB
};

struct NvmeLayoutEntry {
  uint64_t id = 0;
  uint64_t bytes = 0;
  std::string state_class;
};

class NvmeLayout {
 public:
  // Assigns slots to `entries`, opens (creating) and preallocates one striped file per state
  // class. InvalidArgument when `paths` is empty or an entry has 0 bytes; the store's errors
  // (missing directory, no space) otherwise.
  static Result<std::unique_ptr<NvmeLayout>> Create(io::BlockStore& store,
                                                    const NvmeLayoutOptions& options,
                                                    std::span<const NvmeLayoutEntry> entries);
  // Closes the files and removes them unless keep_files.
  ~NvmeLayout();
  NvmeLayout(const NvmeLayout&) = delete;
  NvmeLayout& operator=(const NvmeLayout&) = delete;

  const NvmeSlot* Find(uint64_t id) const;
  // The files (one per class), each as the list of striped paths.
  const std::vector<std::vector<std::string>>& files() const { return file_paths_; }
  uint64_t total_bytes() const { return total_bytes_; }  // over all classes
  bool direct() const { return direct_; }

 private:
  NvmeLayout(io::BlockStore& store, NvmeLayoutOptions options)
      : store_(store), options_(std::move(options)) {}

  io::BlockStore& store_;
  NvmeLayoutOptions options_;
  std::vector<io::FileId> files_;
  std::vector<std::vector<std::string>> file_paths_;
  std::unordered_map<uint64_t, NvmeSlot> slots_;
  std::vector<FileLock> locks_;  // released after the files are removed (member order)
  uint64_t total_bytes_ = 0;
  bool direct_ = false;
};

}  // namespace strata::offload
