// The part that the store wrappers (fault injection, pacing) share: every BlockStore method but
// Submit goes to the inner store, and Close is refused while the wrapper itself still holds
// requests on the file (delayed, or completed by the inner store but not yet called back).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "strata/block_store.h"

namespace strata::io::internal {

class StoreWrapper : public BlockStore {
 public:
  // name(): "<kind>(<inner's name>)", or "<kind>(<inner's name>, <detail>)". `held` names what
  // Close counts in its refusal, e.g. "delayed request(s)".
  StoreWrapper(std::unique_ptr<BlockStore> inner, std::string_view kind, std::string_view detail,
               std::string held);

  std::string_view name() const override { return name_; }
  Result<FileId> Open(const FileSpec& spec) override { return inner_->Open(spec); }
  Status Close(FileId file) override;
  Result<FileInfo> Info(FileId file) const override { return inner_->Info(file); }
  Status Sync(FileId file) override { return inner_->Sync(file); }
  Status RegisterBuffers(std::span<const BufferRange> ranges) override {
    return inner_->RegisterBuffers(ranges);
  }
  Status UnregisterBuffers(const void* base) override { return inner_->UnregisterBuffers(base); }
  StoreStats stats() const override { return inner_->stats(); }

 protected:
  // One more / one fewer request on `file` that the wrapper holds; Close refuses while any is.
  // A wrapper lets go of a request just before its callback runs, so that a caller woken by that
  // callback may close the file at once.
  void Hold(FileId file);
  void LetGo(FileId file);

  // Derived destructors reset it once their own threads are done with it.
  std::unique_ptr<BlockStore> inner_;

 private:
  std::string name_;
  std::string held_;
  std::mutex held_mu_;
  std::unordered_map<FileId, int64_t> held_count_;
};

}  // namespace strata::io::internal
