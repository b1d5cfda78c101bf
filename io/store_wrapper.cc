#include "io/store_wrapper.h"

#include <fmt/format.h>

namespace strata::io::internal {

StoreWrapper::StoreWrapper(std::unique_ptr<BlockStore> inner, std::string_view kind,
                           std::string_view detail, std::string held)
    : inner_(std::move(inner)),
      name_(detail.empty() ? fmt::format("{}({})", kind, inner_->name())
                           : fmt::format("{}({}, {})", kind, inner_->name(), detail)),
      held_(std::move(held)) {}

Status StoreWrapper::Close(FileId file) {
  {
    std::lock_guard lock(held_mu_);
    auto it = held_count_.find(file);
    if (it != held_count_.end() && it->second > 0) {
      return FailedPreconditionError(fmt::format(
          "cannot close file id {}: {} {} on it have not completed", file, it->second, held_));
    }
  }
  return inner_->Close(file);
}

void StoreWrapper::Hold(FileId file) {
  std::lock_guard lock(held_mu_);
  ++held_count_[file];
}

void StoreWrapper::LetGo(FileId file) {
  std::lock_guard lock(held_mu_);
  if (--held_count_[file] == 0) held_count_.erase(file);
}

}  // namespace strata::io::internal
