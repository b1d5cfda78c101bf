#include "zero/gradient_reducer.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "strata/trace.h"

namespace strata::zero::engine_internal {

GradientReducer::~GradientReducer() {
  for (auto* buffers : {&full_grads_, &device_shards_}) {
    for (void* p : *buffers) device_.Free(p);
  }
  device_.Free(bucket_);
  device_.Free(qgz_staging_);
}

// ---- set-up -------------------------------------------------------------------------------------

Status GradientReducer::AllocateAccumulator(int u) {
  pending_grads_.push_back(nullptr);
  void* accumulator = nullptr;
  if (setup_.stage <= 1 && !setup_.is_frozen(u)) {
    const auto padded = static_cast<uint64_t>(layout(u).padded_numel());
    STRATA_ASSIGN_OR_RETURN(accumulator, device_.Alloc(padded * 4));
  }
  full_grads_.push_back(accumulator);
  return Status::Ok();
}

Status GradientReducer::AllocateShard(int u) {
  const auto shard = static_cast<uint64_t>(layout(u).shard_numel);
  void* device_shard = nullptr;
  HostBuffer host_shard;
  if (setup_.is_frozen(u)) {
    // no gradient
  } else if (!setup_.on_cpu(u)) {
    if (setup_.stage >= 2) {
      STRATA_ASSIGN_OR_RETURN(device_shard, device_.Alloc(shard * 4));
    }
  } else if (!setup_.stream_grad_shards) {  // streamed: allocated when it lands
    STRATA_ASSIGN_OR_RETURN(host_shard,
                            HostBuffer::Make(pool_, shard * 4, "gradient shard (host)"));
  }
  device_shards_.push_back(device_shard);
  host_shards_.push_back(std::move(host_shard));
  return Status::Ok();
}

Status GradientReducer::AllocateShared() {
  const EngineSetup& s = setup_;
  bucket_capacity_ =
      ReduceBucketCapacity(config_, s.layouts, s.frozen, s.world_size, s.overlapped_optimizer);
  if (bucket_capacity_ > 0) {
    STRATA_ASSIGN_OR_RETURN(
        bucket_, device_.Alloc(static_cast<uint64_t>(bucket_capacity_) * s.world_size * 4));
  }
  if (s.quantized_grads) {
    // The largest reduction: a unit reduced alone, or a full bucket (whole shards, so a multiple
    // of the block).
    int64_t max_count = bucket_capacity_ / kQuantBlockElems * kQuantBlockElems;
    for (int u = 0; u < s.units(); ++u) {
      if (!s.is_frozen(u)) max_count = std::max(max_count, layout(u).shard_numel);
    }
    const auto count = static_cast<size_t>(max_count);
    qgz_staging_bytes_ = QuantizedReduceScatter::StagingBytes(s.topology, count);
    STRATA_ASSIGN_OR_RETURN(qgz_staging_, device_.Alloc(qgz_staging_bytes_));
    qgz_.emplace(device_, s.topology, groups_, qgz_staging_, count);
  }
  if (s.cpu_optimizer) {
    int64_t largest_offloaded = 0;
    for (int u = 0; u < s.units(); ++u) {
      if (s.on_cpu(u)) {
        largest_offloaded =
            std::max(largest_offloaded, s.layouts[static_cast<size_t>(u)].shard_numel);
      }
    }
    STRATA_ASSIGN_OR_RETURN(landing_, HostBuffer::Make(pool_, largest_offloaded * 4,
                                                       "gradient landing buffer (host)"));
  }
  return Status::Ok();
}

// ---- backward -----------------------------------------------------------------------------------

Status GradientReducer::ZeroAccumulators() {
  for (int u = 0; u < setup_.units(); ++u) {
    const auto padded = static_cast<size_t>(layout(u).padded_numel());
    if (setup_.stage <= 1 && !setup_.is_frozen(u)) {
      STRATA_RETURN_IF_ERROR(device_.Fill(full_grads_[static_cast<size_t>(u)], DType::kF32,
                                            0.0f, padded, *streams_.compute));
    }
  }
  return Status::Ok();
}

Result<void*> GradientReducer::GradientBuffer(int v) {
  if (setup_.is_frozen(v)) return nullptr;
  if (void* held = std::exchange(pending_grads_[static_cast<size_t>(v)], nullptr)) return held;
  const auto padded = static_cast<size_t>(layout(v).padded_numel());
  STRATA_ASSIGN_OR_RETURN(void* grads, live_.Alloc(padded * 4));
  STRATA_RETURN_IF_ERROR(
      device_.Fill(grads, DType::kF32, 0.0f, padded, *streams_.compute));
  return grads;
}

Status GradientReducer::Reduce(int u, void* grads, int mb, bool last) {
  if (setup_.stage <= 1) {
    const auto padded = static_cast<size_t>(layout(u).padded_numel());
    STRATA_RETURN_IF_ERROR(device_.Axpy(1.0f, grads, full_grads_[static_cast<size_t>(u)],
                                          DType::kF32, padded, *streams_.compute));
    return live_.FreeAfter(*streams_.compute, grads);
  }
  // Stages 2-3: keep only the shard.
  STRATA_RETURN_IF_ERROR(device_.Record(*streams_.compute_event, *streams_.compute));
  STRATA_RETURN_IF_ERROR(device_.Wait(*streams_.comm, *streams_.compute_event));
  if (Bucketed(u)) return AddToBucket(u, grads, mb, last);
  return ReduceAlone(u, grads, mb, last);
}

Status GradientReducer::SkipFrozen(int u) {
  // Frozen parameters have no gradient; a bucket still waiting for the end of this
  // micro-batch's backward is reduced now.
  if (u == 0 && bucket_fill_ > 0) STRATA_RETURN_IF_ERROR(FlushBucket());
  return Status::Ok();
}

// Into the bucket (each rank's part at its stride), then the unit's buffer can go.
Status GradientReducer::AddToBucket(int u, void* grads, int mb, bool last) {
  const UnitLayout& l = layout(u);
  const auto shard = static_cast<size_t>(l.shard_numel);
  if (bucket_fill_ + static_cast<int64_t>(shard) > bucket_capacity_) {
    STRATA_RETURN_IF_ERROR(FlushBucket());
  }
  for (int r = 0; r < setup_.world_size; ++r) {
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(
        static_cast<char*>(bucket_) +
            (static_cast<int64_t>(r) * bucket_capacity_ + bucket_fill_) * 4,
        static_cast<const char*>(grads) + l.shard_offset(r) * 4, shard * 4,
        device::CopyKind::kDeviceToDevice, *streams_.comm));
  }
  bucket_entries_.push_back(BucketEntry{u, bucket_fill_, mb, last});
  bucket_fill_ += static_cast<int64_t>(shard);
  STRATA_RETURN_IF_ERROR(live_.FreeAfter(*streams_.comm, grads));
  if (u == 0) STRATA_RETURN_IF_ERROR(FlushBucket());  // backward of this micro-batch ends
  return Status::Ok();
}

// A unit too large for the bucket: one reduce-scatter of its own, after the bucket's.
Status GradientReducer::ReduceAlone(int u, void* grads, int mb, bool last) {
  const UnitLayout& l = layout(u);
  const auto shard = static_cast<size_t>(l.shard_numel);
  if (bucket_fill_ > 0) STRATA_RETURN_IF_ERROR(FlushBucket());  // keep the reductions in order
  char* own = static_cast<char*>(grads) + l.shard_offset(setup_.rank) * 4;
  bool direct = false;
  if (!setup_.on_cpu(u) && mb == 0) {
    STRATA_RETURN_IF_ERROR(
        ReduceScatterParts(grads, shard, shard, device_shards_[static_cast<size_t>(u)]));
    direct = true;
  } else {
    STRATA_RETURN_IF_ERROR(ReduceScatterParts(grads, shard, shard, own));
  }
  STRATA_RETURN_IF_ERROR(FinishReducedShard(u, own, mb, last, direct));
  STRATA_RETURN_IF_ERROR(live_.FreeAfter(*streams_.comm, grads));
  // overlap_comm false: the rest of backward waits for this reduction (DeepSpeed's behaviour).
  if (!config_.zero.overlap_comm) STRATA_RETURN_IF_ERROR(clock_.ComputeWaitsForComm());
  return Status::Ok();
}

// A unit's reduced gradient shard is at `own` (device, comm-stream order): accumulate it where
// the optimizer reads it, and in the last micro-batch queue the unit's overlapped optimizer step.
Status GradientReducer::FinishReducedShard(int u, void* own, int mb, bool last, bool direct_done) {
  const auto shard = static_cast<size_t>(layout(u).shard_numel);
  void* device_shard = device_shards_[static_cast<size_t>(u)];
  if (!direct_done) {
    if (setup_.on_cpu(u)) {
      STRATA_RETURN_IF_ERROR(LandHostShard(u, own, mb));
    } else if (mb == 0) {
      STRATA_RETURN_IF_ERROR(device_.CopyAsync(device_shard, own, shard * 4,
                                                 device::CopyKind::kDeviceToDevice,
                                                 *streams_.comm));
    } else {
      STRATA_RETURN_IF_ERROR(
          device_.Axpy(1.0f, own, device_shard, DType::kF32, shard, *streams_.comm));
    }
  }
  if (last && setup_.overlapped_optimizer && setup_.on_cpu(u)) {
    STRATA_RETURN_IF_ERROR(QueueWhenFinal(u));
  }
  return Status::Ok();
}

Status GradientReducer::QueueWhenFinal(int u) {
  std::shared_ptr<device::Event> ready;
  STRATA_ASSIGN_OR_RETURN(auto event, device_.CreateEvent());
  ready = std::move(event);
  STRATA_RETURN_IF_ERROR(device_.Record(*ready, *streams_.comm));
  return shard_final_(u, std::move(ready));
}

// One reduce-scatter for every unit in the bucket (the whole capacity: the parts past the fill
// hold stale values, reduced and never read), then each unit's piece of this rank's block.
Status GradientReducer::FlushBucket() {
  if (bucket_entries_.empty()) return Status::Ok();
  char* own = static_cast<char*>(bucket_) + static_cast<int64_t>(setup_.rank) * bucket_capacity_ * 4;
  const auto capacity = static_cast<size_t>(bucket_capacity_);
  // qgZ reduces the filled part of each rank's block only (whole shards: whole blocks).
  STRATA_RETURN_IF_ERROR(ReduceScatterParts(
      bucket_, capacity, qgz_ ? static_cast<size_t>(bucket_fill_) : capacity, own));
  std::vector<BucketEntry> entries = std::move(bucket_entries_);
  bucket_entries_.clear();
  bucket_fill_ = 0;
  for (const BucketEntry& e : entries) {
    STRATA_RETURN_IF_ERROR(FinishReducedShard(e.unit, own + e.offset * 4, e.mb, e.last, false));
  }
  if (!config_.zero.overlap_comm) STRATA_RETURN_IF_ERROR(clock_.ComputeWaitsForComm());
  return Status::Ok();
}

Status GradientReducer::ReduceScatterParts(const void* send, size_t stride, size_t count,
                                           void* recv) {
  if (qgz_) {
    return qgz_->Run(static_cast<const float*>(send), stride, count, static_cast<float*>(recv),
                     *streams_.comm);
  }
  // The fp32 reduce-scatter's parts are contiguous: every caller passes count == stride.
  if (count != stride) {
    return InternalError(fmt::format("gradient reduce-scatter: {} elements at stride {}", count,
                                     stride));
  }
  return collective_.ReduceScatter(send, recv, count, DType::kF32, comm::ReduceOp::kSum,
                                   *streams_.comm);
}

// Stages 0-1: after every micro-batch's backward, one all-reduce (stage 0) or reduce-scatter
// (stage 1) per unit, last unit first; the CPU optimizer's units land on the host.
Status GradientReducer::ReduceAccumulated() {
  const EngineSetup& s = setup_;
  device::Stream& comm = *streams_.comm;
  STRATA_RETURN_IF_ERROR(device_.Record(*streams_.compute_event, *streams_.compute));
  STRATA_RETURN_IF_ERROR(device_.Wait(comm, *streams_.compute_event));
  for (int u = s.units() - 1; u >= 0; --u) {
    if (s.is_frozen(u)) continue;
    const UnitLayout& l = s.layouts[static_cast<size_t>(u)];
    void* full = full_grads_[static_cast<size_t>(u)];
    if (s.stage == 0) {
      STRATA_RETURN_IF_ERROR(collective_.AllReduce(full, full,
                                                     static_cast<size_t>(l.padded_numel()),
                                                     DType::kF32, comm::ReduceOp::kSum, comm));
    } else {
      char* own = static_cast<char*>(full) + l.shard_offset(s.rank) * 4;
      STRATA_RETURN_IF_ERROR(collective_.ReduceScatter(
          full, own, static_cast<size_t>(l.shard_numel), DType::kF32, comm::ReduceOp::kSum, comm));
      if (s.on_cpu(u)) STRATA_RETURN_IF_ERROR(LandHostShard(u, own, 0));
    }
  }
  if (!s.overlapped_optimizer) return Status::Ok();
  // Every unit's shard is final once the comm stream gets here: one event for all.
  std::shared_ptr<device::Event> ready;
  STRATA_ASSIGN_OR_RETURN(auto event, device_.CreateEvent());
  ready = std::move(event);
  STRATA_RETURN_IF_ERROR(device_.Record(*ready, comm));
  for (int u = s.units() - 1; u >= 0; --u) {
    if (s.on_cpu(u)) STRATA_RETURN_IF_ERROR(shard_final_(u, ready));
  }
  return Status::Ok();
}

// ---- landing on the host ------------------------------------------------------------------------

// Streamed shards: allocated now and freed by the unit's optimizer job; with the pool full, wait
// for a job to free one (each holder's job is queued already, so one will).
Status GradientReducer::AllocateStreamedShard(int u) {
  const auto shard = static_cast<size_t>(layout(u).shard_numel);
  for (;;) {
    Result<HostBuffer> b = HostBuffer::Make(pool_, shard * 4, "gradient shard (host)");
    if (b.ok()) {
      host_shards_[static_cast<size_t>(u)] = std::move(*b);
      return Status::Ok();
    }
    if (b.status().code() != StatusCode::kResourceExhausted) return b.status();
    STRATA_ASSIGN_OR_RETURN(const bool freed, cpu_worker_.WaitForFreedGradShard());
    if (!freed) {
      return b.status().WithContext(fmt::format(
          "unit {} ('{}'): no optimizer job holds a gradient shard to free (the pinned pool is "
          "smaller than its plan: strata.memory.pinned_pool)",
          u, layout(u).name));
    }
  }
}

// Copies a reduced gradient shard (device, fp32) to the host and accumulates it, on the comm
// stream.
Status GradientReducer::LandHostShard(int u, const void* device_shard, int mb) {
  const auto shard = static_cast<size_t>(layout(u).shard_numel);
  if (setup_.stream_grad_shards) STRATA_RETURN_IF_ERROR(AllocateStreamedShard(u));
  device::Stream& comm = *streams_.comm;
  float* acc = reinterpret_cast<float*>(host_shards_[static_cast<size_t>(u)].data());
  if (mb == 0) {
    return device_.CopyAsync(acc, device_shard, shard * 4, device::CopyKind::kDeviceToHost,
                               comm);
  }
  float* landing = reinterpret_cast<float*>(landing_.data());
  STRATA_RETURN_IF_ERROR(device_.CopyAsync(landing, device_shard, shard * 4,
                                             device::CopyKind::kDeviceToHost, comm));
  return device_.HostTask(
      comm,
      [acc, landing, shard]() {
        for (size_t i = 0; i < shard; ++i) acc[i] += landing[i];
        return Status::Ok();
      },
      "accumulate gradient shard");
}

// ---- the gradient norm --------------------------------------------------------------------------

// With tensor parallelism each rank's sum counts the parts of parameters that c ranks of its
// group hold (EngineSetup::tp_copies) at 1/c, so that the sum over every rank counts each element
// of the model once.
Result<double> GradientReducer::LocalSumSquares(int64_t* optimizer_wait_ns) {
  double total = 0.0;
  if (setup_.device_optimizer) {
    STRATA_ASSIGN_OR_RETURN(total, DeviceSumSquares());
  }
  // Offloaded units (the last ones): their gradient shards already sit in host memory, where the
  // optimizer reads them.
  for (int u = 0; u < setup_.units(); ++u) {
    if (!setup_.on_cpu(u)) continue;
    total += HostSumSquares(u, optimizer_wait_ns);
  }
  return total;
}

// Units on the device optimizer: a device reduction over their gradients; one double comes back.
Result<double> GradientReducer::DeviceSumSquares() {
  double* host = scalars_.host_sum();
  double* sum = scalars_.device_sum();
  double* host_copied = scalars_.host_copied_sums();
  double* copied = scalars_.device_copied_sums();
  const size_t kinds = setup_.tp_copies.size();
  device::Stream& comm = *streams_.comm;
  host[0] = 0.0;
  std::fill(host_copied, host_copied + kinds, 0.0);
  STRATA_RETURN_IF_ERROR(
      device_.CopyAsync(sum, host, sizeof(double), device::CopyKind::kHostToDevice, comm));
  if (kinds > 0) {
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(copied, host_copied, kinds * sizeof(double),
                                             device::CopyKind::kHostToDevice, comm));
  }
  for (int u = 0; u < setup_.units(); ++u) {
    if (setup_.on_cpu(u) || setup_.is_frozen(u)) continue;
    const UnitLayout& l = layout(u);
    const size_t n = static_cast<size_t>(setup_.stage == 0 ? l.padded_numel() : l.shard_numel);
    STRATA_RETURN_IF_ERROR(device_.SumSquares(DeviceGradient(u), DType::kF32, n, sum, comm));
    for (const EngineSetup::CopiedRange& r : CopiedRangesInShard(u)) {
      STRATA_RETURN_IF_ERROR(device_.SumSquares(DeviceGradient(u) + r.first, DType::kF32,
                                                static_cast<size_t>(r.last - r.first),
                                                copied + r.weight, comm));
    }
  }
  STRATA_RETURN_IF_ERROR(
      device_.CopyAsync(host, sum, sizeof(double), device::CopyKind::kDeviceToHost, comm));
  if (kinds > 0) {
    STRATA_RETURN_IF_ERROR(device_.CopyAsync(host_copied, copied, kinds * sizeof(double),
                                             device::CopyKind::kDeviceToHost, comm));
  }
  STRATA_RETURN_IF_ERROR(device_.Synchronize(comm));
  double total = host[0];
  for (size_t k = 0; k < kinds; ++k) total -= CopiedDiscount(static_cast<int>(k)) * host_copied[k];
  return total;
}

std::vector<EngineSetup::CopiedRange> GradientReducer::CopiedRangesInShard(int u) const {
  std::vector<EngineSetup::CopiedRange> out;
  if (setup_.tensor_parallel == 1) return out;
  const UnitLayout& l = layout(u);
  const int64_t base = setup_.stage == 0 ? 0 : l.shard_offset(setup_.rank);
  const int64_t n = setup_.stage == 0 ? l.padded_numel() : l.shard_numel;
  for (const EngineSetup::CopiedRange& r : setup_.tp_copied[static_cast<size_t>(u)]) {
    const int64_t lo = std::max(r.first, base), hi = std::min(r.last, base + n);
    if (lo < hi) out.push_back({lo - base, hi - base, r.weight});
  }
  return out;
}

double GradientReducer::HostShardSumSquares(int u, const float* shard, int threads) const {
  double total = device::SumSquaresHost(shard, DType::kF32,
                                        static_cast<size_t>(layout(u).shard_numel), threads);
  for (const EngineSetup::CopiedRange& r : CopiedRangesInShard(u)) {
    total -= CopiedDiscount(r.weight) *
             device::SumSquaresHost(shard + r.first, DType::kF32,
                                    static_cast<size_t>(r.last - r.first), threads);
  }
  return total;
}

// A host-homed unit's sum of squares of its gradient shard: taken by the overlapped optimizer's
// job when it updated the unit (during backward), else computed now on the CPU AdamW's threads.
double GradientReducer::HostSumSquares(int u, int64_t* optimizer_wait_ns) {
  // Overlapped: the unit's job takes it (the step waits for every job right after the norm
  // anyway); a job that failed or was skipped leaves it to be computed here. The wait is for
  // the optimizer's work (its NVMe reads and updates), so it is counted as the optimizer's.
  const std::optional<double> taken =
      cpu_worker_.TakeSumSquares(u, setup_.overlapped_optimizer, optimizer_wait_ns);
  if (taken) return *taken;
  // A streamed shard that never landed (the step failed before it): the step reports that.
  const HostBuffer& shard = host_shards_[static_cast<size_t>(u)];
  if (shard.data() == nullptr) return 0.0;
  return HostShardSumSquares(u, reinterpret_cast<const float*>(shard.data()), cpu_adam_threads_);
}

const float* GradientReducer::DeviceGradient(int u) const {
  const UnitLayout& l = layout(u);
  if (setup_.stage == 0) return static_cast<const float*>(full_grads_[static_cast<size_t>(u)]);
  if (setup_.stage == 1) {
    return static_cast<const float*>(full_grads_[static_cast<size_t>(u)]) + l.shard_offset(setup_.rank);
  }
  return static_cast<const float*>(device_shards_[static_cast<size_t>(u)]);
}

void GradientReducer::ForgetStep() {
  bucket_entries_.clear();
  bucket_fill_ = 0;
  std::fill(pending_grads_.begin(), pending_grads_.end(), nullptr);
}

}  // namespace strata::zero::engine_internal
