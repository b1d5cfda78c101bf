// CollectiveWrapper: a Collective that forwards every call to the Collective it wraps, so that a
// test overrides only the call it changes (make rank 1's next reduce-scatter fail, count the
// all-gathers, delay a barrier) — the pattern of io/store_wrapper.h and device/device_wrapper.h.
//
//   class FailingReduceScatter final : public CollectiveWrapper {
//    public:
//     using CollectiveWrapper::CollectiveWrapper;
//     Status ReduceScatter(...) override { return InternalError("injected"); }
//   };
//
// The wrapper owns the wrapped Collective and destroys it with itself; the contract of
// strata/collective.h (every rank enqueues the same operations in the same order, the Collective
// outlives its work and goes before its Device) holds for the wrapper as for what it wraps.
// Threading: as Collective; a derived class that adds state guards it itself.
#pragma once

#include <memory>

#include "strata/collective.h"

namespace strata::comm {

class CollectiveWrapper : public Collective {
 public:
  // `inner` must not be null.
  explicit CollectiveWrapper(std::unique_ptr<Collective> inner) : inner_(std::move(inner)) {}

  Collective& inner() const { return *inner_; }

  Backend backend() const override { return inner_->backend(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }

  Status AllGather(const void* send, void* recv, size_t count, device::DType dtype,
                   device::Stream& stream) override {
    return inner_->AllGather(send, recv, count, dtype, stream);
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, device::DType dtype, ReduceOp op,
                       device::Stream& stream) override {
    return inner_->ReduceScatter(send, recv, count, dtype, op, stream);
  }
  Status AllReduce(const void* send, void* recv, size_t count, device::DType dtype, ReduceOp op,
                   device::Stream& stream) override {
    return inner_->AllReduce(send, recv, count, dtype, op, stream);
  }
  Status AllToAll(const void* send, void* recv, size_t count, device::DType dtype,
                  device::Stream& stream) override {
    return inner_->AllToAll(send, recv, count, dtype, stream);
  }
  Status Broadcast(void* buf, size_t bytes, int root, device::Stream& stream) override {
    return inner_->Broadcast(buf, bytes, root, stream);
  }
  Status Barrier(device::Stream& stream) override { return inner_->Barrier(stream); }
  // The inner collective's split, unwrapped: a derived class that must see the sub-group's
  // operations too wraps the result itself.
  Result<std::unique_ptr<Collective>> Split(int color, int key) override {
    return inner_->Split(color, key);
  }

 private:
  std::unique_ptr<Collective> inner_;
};

}  // namespace strata::comm
