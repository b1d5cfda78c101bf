// strata_overlap_bench's unit compute on a CUDA device (see overlap_compute.h): per access, three
// D2H copies of the unit's sampled floats into a registered host slot, a host task that compares
// the slot with what was written, and the GEMM on cuBLAS between two timing events, all in
// order on the compute stream. Built only with CUDA.
//
// Per access k, on the compute stream, with slot s = k mod S (S = in_flight + 1):
//   [d2h x3 -> slot s] [host task: check slot s] [event start_s] [LinearForward x reps]
//   [event end_s] [event done_s]
// Before slot s is reused, Enqueue synchronizes done_s (recorded after the slot's previous
// access, so its copies, host task and GEMMs have all run; with the caller's run-ahead window
// that access finished long ago and the call returns at once) and adds that access's
// end_s - start_s to the GEMM time.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/host_memory.h"
#include "device/cuda_device.h"
#include "model/cuda_ops.h"
#include "model/cuda_ops_status.h"
#include "overlap_compute.h"

namespace strata::bench {
namespace {

Status Cuda(cudaError_t err, std::string_view call) {
  return device::CudaErrorToStatus(static_cast<int>(err), call, "overlap bench");
}

// Floats per slot: the three samples, padded to a 64-byte line of their own.
constexpr size_t kSlotFloats = 16;

class CudaUnitCompute final : public UnitCompute {
 public:
  static Result<std::unique_ptr<UnitCompute>> Create(device::Device& device, device::Stream& stream,
                                                     std::optional<GemmShape> shape,
                                                     int in_flight) {
    if (device.type() != device::DeviceType::kCuda) {
      return InvalidArgumentError(
          fmt::format("cuda unit compute: device '{}' is not a CUDA device", device.name()));
    }
    if (in_flight < 0) {
      return InvalidArgumentError(fmt::format("cuda unit compute: in_flight {}", in_flight));
    }
    if (shape && (shape->m < 1 || shape->n < 1 || shape->reps < 1)) {
      return InvalidArgumentError(fmt::format("cuda unit compute: GEMM shape {} x {} x {} reps",
                                              shape->m, shape->n, shape->reps));
    }
    std::unique_ptr<CudaUnitCompute> c(new CudaUnitCompute(device, stream, shape));
    STRATA_RETURN_IF_ERROR(c->Init(static_cast<size_t>(in_flight) + 1));
    return std::unique_ptr<UnitCompute>(std::move(c));
  }

  ~CudaUnitCompute() override {
    // Work still queued may write the slots and read x, y and the unit (after an error that
    // ended a run early). Its status was (or will be) reported by the caller's own Synchronize.
    device_->Synchronize(*stream_).IgnoreError();
    ops_.reset();  // waits for the stream again, then destroys the cuBLAS handle
    for (Slot& s : slots_) {
      if (s.start != nullptr) (void)cudaEventDestroy(s.start);
      if (s.end != nullptr) (void)cudaEventDestroy(s.end);
    }
    (void)cudaGetLastError();  // a failed destroy must not surface in an unrelated later call
    slots_.clear();            // the done events (device::Event)
    device_->Free(x_);
    device_->Free(y_);
    if (registered_) {
      Status st = device_->UnregisterHost(host_.data());
      if (!st.ok()) fmt::print(stderr, "warning: {}\n", st.ToString());
    }
    // host_ is unmapped by its destructor, after the unregistration.
  }

  Status Enqueue(const float* w, const UnitCheck* check, bool gemm,
                 std::string_view label) override {
    if (gemm && !shape_) {
      return InvalidArgumentError(
          fmt::format("{}: a GEMM was asked of a unit compute made without a shape", label));
    }
    Slot& s = slots_[next_ % slots_.size()];
    ++next_;
    // The slot's previous access must have run before its floats are overwritten and its
    // events re-recorded (a no-op while the slot was never used). Returns the sticky error of a
    // failed check.
    STRATA_RETURN_IF_ERROR(device_->Synchronize(*s.done));
    STRATA_RETURN_IF_ERROR(Harvest(s));
    if (check != nullptr) {
      for (size_t i = 0; i < check->positions.size(); ++i) {
        // Source: inside the unit's device allocation; destination: the registered slot, so the
        // copy is asynchronous (a D2H copy to pageable memory would wait for the stream).
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(&s.samples[i], w + check->positions[i],
                                                  sizeof(float), device::CopyKind::kDeviceToHost,
                                                  *stream_));
      }
      const float* samples = s.samples;
      const UnitCheck c = *check;
      // Runs on the CUDA runtime's host-function thread: no CUDA calls in here.
      STRATA_RETURN_IF_ERROR(device_->HostTask(
          *stream_,
          [samples, c]() -> Status {
            for (size_t i = 0; i < c.positions.size(); ++i) {
              if (std::memcmp(&samples[i], &c.expect[i], sizeof(float)) != 0) {
                return DataLossError(
                    fmt::format("layer.{}: float {} reads {} in device memory, {} was written",
                                c.unit, c.positions[i], samples[i], c.expect[i]));
              }
            }
            return Status::Ok();
          },
          "check"));
    }
    if (gemm) {
      STRATA_RETURN_IF_ERROR(Cuda(cudaEventRecord(s.start, native_), "cudaEventRecord"));
      // y [M, K] = x [M, n] W^T, W = the unit's leading K x n floats as [out = K, in = n].
      const model::cuda::Weight weight{w, model::cuda::DType::kF32};
      for (int r = 0; r < shape_->reps; ++r) {
        STRATA_RETURN_IF_ERROR(model::cuda::ToStatus(model::cuda::LinearForward(
            ops_.get(), model::cuda::CAct(x_, model::cuda::DType::kF32), weight,
            static_cast<size_t>(shape_->m), static_cast<size_t>(shape_->n),
            static_cast<size_t>(kGemmK), model::cuda::Act{y_, model::cuda::DType::kF32})));
      }
      STRATA_RETURN_IF_ERROR(Cuda(cudaEventRecord(s.end, native_), "cudaEventRecord"));
      s.timed = true;
    }
    return device_->Record(*s.done, *stream_);
  }

  Result<double> GemmSeconds() override {
    for (Slot& s : slots_) {
      STRATA_RETURN_IF_ERROR(Harvest(s));
    }
    return gemm_s_;
  }

 private:
  struct Slot {
    float* samples = nullptr;             // kSlotFloats floats of the registered buffer
    std::unique_ptr<device::Event> done;  // recorded after the slot's latest access
    cudaEvent_t start = nullptr;          // around that access's GEMMs (timing events; only
    cudaEvent_t end = nullptr;            //   with a shape)
    bool timed = false;                   // start..end holds GEMMs not yet added to gemm_s_
  };

  CudaUnitCompute(device::Device& device, device::Stream& stream, std::optional<GemmShape> shape)
      : device_(&device), stream_(&stream), shape_(shape) {}

  Status Init(size_t slots) {
    STRATA_ASSIGN_OR_RETURN(void* native, device::NativeCudaStream(*stream_));
    native_ = static_cast<cudaStream_t>(native);

    // The sample slots: one small registered buffer (page-aligned, zero-filled).
    STRATA_ASSIGN_OR_RETURN(
        host_, HostRegion::Allocate(slots * kSlotFloats * sizeof(float), HugePages::kOff));
    STRATA_RETURN_IF_ERROR(device_->RegisterHost(host_.data(), host_.size()));
    registered_ = true;
    slots_.resize(slots);
    for (size_t i = 0; i < slots; ++i) {
      slots_[i].samples = reinterpret_cast<float*>(host_.data()) + i * kSlotFloats;
      STRATA_ASSIGN_OR_RETURN(slots_[i].done, device_->CreateEvent());
    }
    if (!shape_) return Status::Ok();

    // The cuBLAS context on the compute stream (it also makes the stream's GPU this thread's
    // current device, where the timing events below are created). LinearForward with an fp32
    // weight runs cublasGemmEx straight on x, W and y: it takes no workspace, so no
    // ReserveWorkspace and no cudaMalloc happens inside a step.
    STRATA_ASSIGN_OR_RETURN(ops_, model::cuda::CreateOpsContext(*stream_));
    for (Slot& s : slots_) {
      // Blocking sync: a wait sleeps instead of spinning (it never has to wait; see Enqueue).
      STRATA_RETURN_IF_ERROR(
          Cuda(cudaEventCreateWithFlags(&s.start, cudaEventBlockingSync), "cudaEventCreate"));
      STRATA_RETURN_IF_ERROR(
          Cuda(cudaEventCreateWithFlags(&s.end, cudaEventBlockingSync), "cudaEventCreate"));
    }
    STRATA_ASSIGN_OR_RETURN(void* x, device_->Alloc(GemmInputBytes(*shape_)));
    x_ = static_cast<float*>(x);
    STRATA_ASSIGN_OR_RETURN(void* y, device_->Alloc(GemmOutputBytes(*shape_)));
    y_ = static_cast<float*>(y);
    return FillInput();
  }

  // x = deterministic floats in [-1, 1): up to 1 MiB of them copied from the host, then
  // repeated by device-to-device copies that double the filled prefix. y needs no content (the
  // GEMM's beta is 0).
  Status FillInput() {
    const size_t total = GemmInputBytes(*shape_) / sizeof(float);
    std::vector<float> host(std::min<size_t>(total, size_t{1} << 18));
    FloatStream(12345).Fill(host.data(), host.size());
    // From pageable memory: may return only once the copy ran, and `host` lives until the
    // Synchronize below in any case.
    Status st = device_->CopyAsync(x_, host.data(), host.size() * sizeof(float),
                                   device::CopyKind::kHostToDevice, *stream_);
    for (size_t filled = host.size(); st.ok() && filled < total;) {
      const size_t n = std::min(filled, total - filled);  // [0, n) and [filled, +n): disjoint
      st = device_->CopyAsync(x_ + filled, x_, n * sizeof(float), device::CopyKind::kDeviceToDevice,
                              *stream_);
      filled += n;
    }
    // Wait even after a failed enqueue: an earlier copy may still read `host`.
    Status synced = device_->Synchronize(*stream_);
    STRATA_RETURN_IF_ERROR(st.WithContext("filling the GEMM's input"));
    return synced.WithContext("filling the GEMM's input");
  }

  // Adds the slot's last GEMM time to gemm_s_. Its end event is complete whenever the slot's
  // done event is (recorded after it on the same stream); the synchronize is a safeguard.
  Status Harvest(Slot& s) {
    if (!s.timed) return Status::Ok();
    STRATA_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(s.end), "cudaEventSynchronize"));
    float ms = 0;
    STRATA_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, s.start, s.end), "cudaEventElapsedTime"));
    gemm_s_ += static_cast<double>(ms) * 1e-3;
    s.timed = false;
    return Status::Ok();
  }

  device::Device* device_;
  device::Stream* stream_;
  cudaStream_t native_ = nullptr;
  std::optional<GemmShape> shape_;
  HostRegion host_;  // the sample slots, registered with the device while registered_
  bool registered_ = false;
  std::vector<Slot> slots_;
  size_t next_ = 0;  // accesses enqueued
  model::cuda::OpsContextPtr ops_;
  float* x_ = nullptr;  // [M, n] from device_
  float* y_ = nullptr;  // [M, K] from device_
  double gemm_s_ = 0;
};

}  // namespace

Result<std::unique_ptr<UnitCompute>> CreateCudaUnitCompute(device::Device& device,
                                                           device::Stream& stream,
                                                           std::optional<GemmShape> shape,
                                                           int in_flight) {
  return CudaUnitCompute::Create(device, stream, shape, in_flight);
}

}  // namespace strata::bench
