// GradientReducer: a step's gradients from the compute stream to where the optimizer reads them.
// Private to src/zero.
//
// Backward hands each trainable unit's full fp32 gradient of a micro-batch (a live buffer, see
// live_buffers.h) to Reduce, which keeps what the rank needs:
//
//   stages 0-1  added into the unit's full accumulator (device); after the last micro-batch
//               ReduceAccumulated all-reduces it (stage 0) or reduce-scatters it (stage 1)
//   stages 2-3  reduce-scattered at once, on the comm stream, into the rank's shard:
//                 small units: copied into the reduction bucket (each rank's part at stride
//                   bucket_capacity), reduced together when it would overflow or backward ends
//                 large units: reduced on their own, after whatever the bucket holds
//               with zero_quantized_gradients (qgZ) each of those reduce-scatters is the
//               two-level int8 all-to-all of quantized_reduce.h instead
//
// A reduced shard then accumulates where the optimizer reads it: a device shard (units on the
// device optimizer) or, for units on the CPU optimizer, a host shard it lands in (D2H on the
// comm stream; later micro-batches land in the landing buffer and are added on the host). In the
// last micro-batch, with the overlapped CPU optimizer, the shard is final once the comm stream
// reaches it: the reducer records an event there and calls `shard_final`, which queues the
// unit's update.
//
// Streamed gradient shards (EngineSetup::stream_grad_shards): a unit's host shard is allocated
// when it lands and freed by its optimizer job (FreeHostShard); with the pool full, landing
// waits for a job to free one.
//
// Threading: every method is called by the engine's driving thread, and everything it enqueues
// runs in comm-stream order. No lock: the only state another thread touches is a unit's host
// gradient shard, which the CPU optimizer's job for that unit reads (HostShard) and may free
// (FreeHostShard) between Queue and the job's completion (cpu_optimizer_worker.h: ownership
// passes with the job).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "strata/collective.h"
#include "strata/config.h"
#include "strata/device.h"
#include "strata/status.h"
#include "zero/cpu_optimizer_worker.h"
#include "zero/engine_setup.h"
#include "zero/host_buffer.h"
#include "zero/live_buffers.h"
#include "zero/quantized_reduce.h"
#include "zero/step_clock.h"
#include "zero/step_scalars.h"

namespace strata::device {
class PinnedPool;
}

namespace strata::zero::engine_internal {

class GradientReducer {
 public:
  // Unit `unit`'s gradient shard is final once the comm stream reaches `ready` (recorded there).
  using ShardFinal = std::function<Status(int unit, std::shared_ptr<device::Event> ready)>;

  struct Parts {
    const EngineSetup& setup;
    const Config& config;
    device::Device& device;
    comm::Collective& collective;
    device::PinnedPool* pool;  // host shards; nullptr: the heap (no CPU optimizer)
    int cpu_adam_threads;
    EngineStreams& streams;
    StepClock& clock;
    LiveBuffers& live;
    CpuOptimizerWorker& cpu_worker;
    StepScalars& scalars;
    // The node groups (qgZ's all-to-alls); filled by Init before AllocateShared when qgZ is on.
    const comm::NodeGroups& groups;
  };
  GradientReducer(const Parts& parts, ShardFinal shard_final)
      : setup_(parts.setup),
        config_(parts.config),
        device_(parts.device),
        collective_(parts.collective),
        pool_(parts.pool),
        cpu_adam_threads_(parts.cpu_adam_threads),
        streams_(parts.streams),
        clock_(parts.clock),
        live_(parts.live),
        cpu_worker_(parts.cpu_worker),
        scalars_(parts.scalars),
        groups_(parts.groups),
        shard_final_(std::move(shard_final)) {}
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Set-up, per unit in unit order (Engine::Impl::AllocateUnit interleaves these with the other
  // components' allocations), then the buffers shared by all units.
  Status AllocateAccumulator(int u);  // stages 0-1: the full fp32 accumulator
  Status AllocateShard(int u);        // stages 2-3 device shard, or the host shard (CPU optimizer)
  Status AllocateShared();            // the reduction bucket and the host landing buffer

  // Stages 0-1, before the step's first micro-batch: the accumulators start at zero.
  Status ZeroAccumulators();
  // The gradient buffer unit v's backward writes into: the one a tying unit already added to, or
  // a zeroed live buffer. nullptr for a frozen unit.
  Result<void*> GradientBuffer(int v);
  // A tying unit's backward added into shared unit s's buffer: it waits for s's own backward.
  void HoldUntilOwnBackward(int s, void* grads) { pending_grads_[static_cast<size_t>(s)] = grads; }

  // Unit u's gradient of micro-batch `mb` (`last`: the step's last) is in `grads`, written by
  // compute; the buffer is freed once the reducer's streams are done with it.
  Status Reduce(int u, void* grads, int mb, bool last);
  // Frozen unit u has no gradient; unit 0 ends backward, so a waiting bucket is reduced.
  Status SkipFrozen(int u);
  // Stages 0-1, after the last micro-batch: reduces the accumulators once.
  Status ReduceAccumulated();

  // Sum of squares of this rank's part of the (summed, unscaled) gradients, in double.
  // `optimizer_wait_ns` gains the time spent waiting for overlapped optimizer jobs to take their
  // units' sums (optimizer time, not the norm's).
  Result<double> LocalSumSquares(int64_t* optimizer_wait_ns);

  // Where the optimizer reads unit u's gradient: on the device (stage 0: the full accumulator;
  // 1: the rank's part of it; 2-3: the device shard) or on the host (CPU optimizer units).
  const float* DeviceGradient(int u) const;
  // The sum of squares of unit `u`'s host gradient shard `shard`, with tensor parallelism
  // weighted (GradientReducer::LocalSumSquares): on `threads` CPU threads.
  double HostShardSumSquares(int u, const float* shard, int threads) const;
  const float* HostShard(int u) const {
    return reinterpret_cast<const float*>(host_shards_[static_cast<size_t>(u)].data());
  }
  // A streamed host shard after its unit's update (the CPU optimizer's thread).
  void FreeHostShard(int u) { host_shards_[static_cast<size_t>(u)] = HostBuffer{}; }

  // After a failed step: forgets the bucket's units and the held gradient buffers (their live
  // buffers are freed by LiveBuffers::FreeOwned).
  void ForgetStep();

  // qgZ's staging on the device (0 without qgZ).
  uint64_t qgz_staging_bytes() const { return qgz_staging_bytes_; }

 private:
  struct BucketEntry {
    int unit;
    int64_t offset;  // in the rank's block of the bucket
    int mb;
    bool last;
  };
  bool Bucketed(int u) const {
    return bucket_ != nullptr && layout(u).shard_numel <= bucket_capacity_;
  }
  Status AddToBucket(int u, void* grads, int mb, bool last);
  Status ReduceAlone(int u, void* grads, int mb, bool last);
  Status FinishReducedShard(int u, void* own, int mb, bool last, bool direct_done);
  Status FlushBucket();
  // recv = the sum over ranks of their part `rank` of send (fp32): parts of `count` elements at
  // `stride`. The fp32 reduce-scatter, or qgZ's two-level int8 all-to-all (quantized_reduce.h).
  Status ReduceScatterParts(const void* send, size_t stride, size_t count, void* recv);
  Status QueueWhenFinal(int u);
  Status LandHostShard(int u, const void* device_shard, int mb);
  Status AllocateStreamedShard(int u);
  Result<double> DeviceSumSquares();
  // Tensor parallelism: unit `u`'s ranges that other ranks of the group hold too
  // (EngineSetup::tp_copied) within the gradient this rank sums (the unit at stage 0, else its
  // shard), relative to its start. Empty without tensor parallelism.
  std::vector<EngineSetup::CopiedRange> CopiedRangesInShard(int u) const;
  // 1 - 1 / c for copy count tp_copies[weight]: the share of such a range's squares that the
  // other c - 1 ranks count too.
  double CopiedDiscount(int weight) const {
    return 1.0 - 1.0 / setup_.tp_copies[static_cast<size_t>(weight)];
  }
  double HostSumSquares(int u, int64_t* optimizer_wait_ns);

  const UnitLayout& layout(int u) const { return setup_.layouts[static_cast<size_t>(u)]; }

  const EngineSetup& setup_;
  const Config& config_;
  device::Device& device_;
  comm::Collective& collective_;
  device::PinnedPool* const pool_;
  const int cpu_adam_threads_;
  EngineStreams& streams_;
  StepClock& clock_;
  LiveBuffers& live_;
  CpuOptimizerWorker& cpu_worker_;
  StepScalars& scalars_;
  const comm::NodeGroups& groups_;
  const ShardFinal shard_final_;

  // Stages 0-1: every unit's full fp32 gradient accumulator (device; nullptr when frozen).
  std::vector<void*> full_grads_;
  // Stages 2-3, units on the device optimizer: the rank's gradient shard (device; nullptr for
  // the others).
  std::vector<void*> device_shards_;
  // Units on the CPU optimizer: the rank's gradient shard (host; empty for the others, and for
  // streamed shards until they land) and the buffer later micro-batches land in.
  std::vector<HostBuffer> host_shards_;
  HostBuffer landing_;
  // Stages 2-3 on several ranks: the reduction bucket (ReduceBucketCapacity elements per rank).
  void* bucket_ = nullptr;
  int64_t bucket_capacity_ = 0;  // elements per rank
  int64_t bucket_fill_ = 0;      // elements per rank in use
  std::vector<BucketEntry> bucket_entries_;
  // Per unit: the gradient buffer a tying unit already added to, waiting for its own backward.
  std::vector<void*> pending_grads_;
  // qgZ (EngineSetup::quantized_grads): its staging (device) and the reduction over it.
  void* qgz_staging_ = nullptr;
  uint64_t qgz_staging_bytes_ = 0;
  std::optional<QuantizedReduceScatter> qgz_;
};

}  // namespace strata::zero::engine_internal
