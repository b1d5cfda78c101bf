#include "zero/live_buffers.h"

#include <utility>

namespace strata::zero::engine_internal {

Result<void*> LiveBuffers::Alloc(uint64_t bytes) {
  {
    MutexLock lock(mu_);
    while (!(live_bytes_ == 0 || live_bytes_ + bytes <= limit_)) freed_.Wait(mu_);
    live_bytes_ += bytes;
  }
  Result<void*> p = device_.Alloc(bytes);
  MutexLock lock(mu_);
  if (!p.ok()) {
    live_bytes_ -= bytes;
    freed_.NotifyAll();
    return p.status();
  }
  owned_.emplace(*p, bytes);
  return p;
}

Status LiveBuffers::FreeAfter(device::Stream& stream, void* ptr) {
  uint64_t bytes = 0;
  {
    MutexLock lock(mu_);
    auto it = owned_.find(ptr);
    if (it == owned_.end()) return InternalError("FreeLiveAfter: not a live buffer");
    bytes = it->second;
    owned_.erase(it);
  }
  Status st = device_.Notify(stream, [this, ptr, bytes](const Status&) {
    device_.Free(ptr);
    {
      MutexLock lock(mu_);
      live_bytes_ -= bytes;
    }
    freed_.NotifyAll();
  });
  if (!st.ok()) {  // not enqueued: take it back so the clean-up frees it
    MutexLock lock(mu_);
    owned_.emplace(ptr, bytes);
  }
  return st;
}

void LiveBuffers::Keep(void* ptr) {
  MutexLock lock(mu_);
  auto it = owned_.find(ptr);
  if (it == owned_.end()) return;
  live_bytes_ -= it->second;
  owned_.erase(it);
}

void LiveBuffers::FreeOwned() {
  std::unordered_map<void*, uint64_t> leftovers;
  {
    MutexLock lock(mu_);
    leftovers.swap(owned_);
    for (const auto& [ptr, bytes] : leftovers) live_bytes_ -= bytes;
  }
  freed_.NotifyAll();
  for (const auto& [ptr, bytes] : leftovers) device_.Free(ptr);
}

}  // namespace strata::zero::engine_internal
