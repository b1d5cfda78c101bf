// DeviceWrapper: a Device that forwards every call to the Device it wraps, so that a decorator (the
// fault-injecting device, fault_device.h) or a test overrides only the calls it changes — the
// pattern of io/store_wrapper.h for BlockStore and of LevelDB's EnvWrapper.
//
//   class CountingDevice final : public DeviceWrapper {
//    public:
//     using DeviceWrapper::DeviceWrapper;
//     Result<void*> Alloc(size_t bytes) override { ++allocs; return DeviceWrapper::Alloc(bytes); }
//     int allocs = 0;
//   };
//
// Streams and events are the wrapped device's own objects: CreateStream and CreateEvent return
// them, and every call hands them to the wrapped device unchanged, so work enqueued through the
// wrapper and work enqueued on the wrapped device directly share one order. Memory is the wrapped
// device's too (a pointer from Alloc is valid for both).
//
// The wrapper owns the wrapped device and destroys it with itself; streams and events must be
// gone first, as for any Device. Threading: as Device (every method from any thread); a derived
// class that adds state guards it itself.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "strata/device.h"

namespace strata::device {

class DeviceWrapper : public Device {
 public:
  // `inner` must not be null. name(): `name`, or the wrapped device's name when empty.
  explicit DeviceWrapper(std::unique_ptr<Device> inner, std::string name = "");

  Device& inner() const { return *inner_; }

  DeviceType type() const override { return inner_->type(); }
  std::string_view name() const override;

  Result<void*> Alloc(size_t bytes) override { return inner_->Alloc(bytes); }
  void Free(void* ptr) override { inner_->Free(ptr); }
  DeviceMemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void ResetPeak() override { inner_->ResetPeak(); }

  Status RegisterHost(void* ptr, size_t bytes) override { return inner_->RegisterHost(ptr, bytes); }
  Status UnregisterHost(void* ptr) override { return inner_->UnregisterHost(ptr); }
  Status UseHostMemoryAsDeviceMemory() override { return inner_->UseHostMemoryAsDeviceMemory(); }

  Result<std::unique_ptr<Stream>> CreateStream(std::string_view name) override {
    return inner_->CreateStream(name);
  }
  Result<std::unique_ptr<Event>> CreateEvent() override { return inner_->CreateEvent(); }
  Status Record(Event& event, Stream& stream) override { return inner_->Record(event, stream); }
  Status Wait(Stream& stream, const Event& event) override { return inner_->Wait(stream, event); }
  Result<bool> Query(const Event& event) override { return inner_->Query(event); }
  Status Synchronize(const Event& event) override { return inner_->Synchronize(event); }
  Status Synchronize(Stream& stream) override { return inner_->Synchronize(stream); }

  Status CopyAsync(void* dst, const void* src, size_t bytes, CopyKind kind,
                   Stream& stream) override {
    return inner_->CopyAsync(dst, src, bytes, kind, stream);
  }
  Status HostTask(Stream& stream, std::function<Status()> fn, std::string_view label) override {
    return inner_->HostTask(stream, std::move(fn), label);
  }
  Status Notify(Stream& stream, std::function<void(const Status&)> fn) override {
    return inner_->Notify(stream, std::move(fn));
  }

  Status Cast(const void* x, DType from, void* y, DType to, size_t n, Stream& stream) override {
    return inner_->Cast(x, from, y, to, n, stream);
  }
  Status Scale(void* x, DType dtype, float alpha, size_t n, Stream& stream) override {
    return inner_->Scale(x, dtype, alpha, n, stream);
  }
  Status Axpy(float alpha, const void* x, void* y, DType dtype, size_t n, Stream& stream) override {
    return inner_->Axpy(alpha, x, y, dtype, n, stream);
  }
  Status Fill(void* x, DType dtype, float value, size_t n, Stream& stream) override {
    return inner_->Fill(x, dtype, value, n, stream);
  }
  Status SumSquares(const void* x, DType dtype, size_t n, double* sum, Stream& stream) override {
    return inner_->SumSquares(x, dtype, n, sum, stream);
  }
  Status QuantizeInt8(const void* x, DType dtype, size_t n, size_t block, void* q, float* scales,
                      Stream& stream) override {
    return inner_->QuantizeInt8(x, dtype, n, block, q, scales, stream);
  }
  Status DequantizeInt8(const void* q, const float* scales, size_t n, size_t block, void* y,
                        DType dtype, Stream& stream) override {
    return inner_->DequantizeInt8(q, scales, n, block, y, dtype, stream);
  }

 private:
  std::unique_ptr<Device> inner_;
  std::string name_;
};

}  // namespace strata::device
