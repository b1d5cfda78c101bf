#include "comm/nccl_collective.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "comm/op.h"
#include "common/log.h"
#include "device/cuda_device.h"
#include "strata/trace.h"

#if defined(STRATA_COMM_WITH_MPI)
#include "comm/mpi_runtime.h"
#endif

namespace strata::comm::internal {

namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the communicator and the operations in flight.
constexpr auto kWatchInterval = std::chrono::milliseconds(100);

// ---- the one place where an NCCL result becomes a Status ---------------------------------------

Status NcclStatus(ncclResult_t result, std::string_view call, std::string_view context,
                  ncclComm_t comm) {
  if (result == ncclSuccess) return Status::Ok();
  const char* detail = ncclGetLastError(comm);
  std::string message = fmt::format("{}: {} failed: {}", context, call, ncclGetErrorString(result));
  if (detail != nullptr && *detail != '\0') message += fmt::format(" ({})", detail);
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return InvalidArgumentError(message);
    case ncclRemoteError:  // a peer failed or went away
    case ncclSystemError:  // a socket, a network device
      return AbortedError(message);
    case ncclInProgress:
      return UnavailableError(message);
    default:
      return InternalError(message);
  }
}

// And the one place in this backend where a CUDA runtime error does.
Status CudaStatus(cudaError_t error, std::string_view call, std::string_view context) {
  if (error == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  return InternalError(fmt::format("{}: {} failed: {} ({})", context, call,
                                   cudaGetErrorString(error), cudaGetErrorName(error)));
}

// kAvg is a sum scaled afterwards (the contract's arithmetic); kMax is NCCL's own.
ncclRedOp_t NcclOp(ReduceOp op) { return op == ReduceOp::kMax ? ncclMax : ncclSum; }

ncclDataType_t NcclType(device::DType dtype) {
  switch (dtype) {
    case device::DType::kF32:
      return ncclFloat32;
    case device::DType::kBF16:
      return ncclBfloat16;
    case device::DType::kF16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

// With a non-blocking communicator a call may return ncclInProgress while NCCL finishes it in the
// background; the next call may only be made once ncclCommGetAsyncError says ncclSuccess.
Status Settle(ncclResult_t result, std::string_view call, std::string_view context, ncclComm_t comm,
              Clock::time_point deadline) {
  while (result == ncclInProgress) {
    if (Clock::now() >= deadline) {
      return DeadlineExceededError(
          fmt::format("{}: {} did not complete before the timeout", context, call));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    ncclResult_t state = ncclSuccess;
    const ncclResult_t queried = ncclCommGetAsyncError(comm, &state);
    if (queried != ncclSuccess) {
      return NcclStatus(queried, "ncclCommGetAsyncError", context, comm);
    }
    result = state;
  }
  return NcclStatus(result, call, context, comm);
}

// What the watchdog and the stream callbacks share. Outlives the Collective if callbacks are
// still queued (they hold a shared_ptr).
struct NcclWatch {
  struct InFlight {
    std::string name;
    bool started = false;
    Clock::time_point start;
    int64_t start_ns = 0;
  };

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  bool stop = false;
  std::map<uint64_t, InFlight> in_flight;  // by sequence number
  Status failure;

  Status Failure() {
    std::lock_guard lock(mu);
    return failure;
  }
  void Fail(const Status& error) {
    std::lock_guard lock(mu);
    if (failure.ok()) failure = error;
  }
};

// The collective over an initialised communicator `comm`: its barrier buffer, its watchdog.
// Aborts `comm` on failure.
Result<std::unique_ptr<Collective>> StartNcclCollective(device::Device& device,
                                                        const CollectiveOptions& options,
                                                        ncclComm_t comm, int rank, int world,
                                                        int ordinal);

class NcclCollective final : public OpCollective {
 public:
  NcclCollective(device::Device& device, const CollectiveOptions& options, ncclComm_t comm,
                 int rank, int world, int ordinal, void* barrier_buffer)
      : device_(device),
        comm_(comm),
        rank_(rank),
        world_(world),
        ordinal_(ordinal),
        timeout_(options.timeout),
        trace_(options.trace),
        track_(options.trace != nullptr ? options.trace->Track("comm") : 0),
        barrier_buffer_(barrier_buffer),
        watch_(std::make_shared<NcclWatch>()),
        options_(options) {}

  // Starts the watchdog. Separate from the constructor so that a failure is a Status.
  Status Start() {
    try {
      watchdog_ = std::thread([this] { Watch(); });
    } catch (const std::system_error& e) {
      return ResourceExhaustedError(fmt::format("nccl: cannot start the watchdog: {}", e.what()));
    }
    return Status::Ok();
  }

  ~NcclCollective() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard lock(watch_->mu);
        watch_->stop = true;
      }
      watch_->cv.notify_all();
      watchdog_.join();
    }
    std::lock_guard lock(mu_);
    (void)cudaSetDevice(ordinal_);
    if (!aborted_) {
      Status closed = watch_->Failure();
      if (closed.ok()) {
        // Flush what was issued, then free; a hang here is bounded like every other call.
        const auto deadline = Clock::now() + timeout_;
        closed = Settle(ncclCommFinalize(comm_), "ncclCommFinalize", "nccl exit", comm_, deadline);
        if (closed.ok()) {
          closed = NcclStatus(ncclCommDestroy(comm_), "ncclCommDestroy", "nccl exit", comm_);
        }
      }
      if (!closed.ok()) {
        STRATA_LOG(warn, comm, "{}; aborting the communicator", closed.ToString());
        (void)ncclCommAbort(comm_);
      }
    }
    device_.Free(barrier_buffer_);
  }

  Backend backend() const override { return Backend::kNccl; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  // ncclCommSplit of this communicator (NCCL >= 2.18), non-blocking and bounded by the timeout.
  Result<std::unique_ptr<Collective>> Split(int color, int key) override;

 private:
  Status Run(const OpDesc& desc, device::Stream& stream) override;
  // The NCCL calls (and the device's Cast / Scale) of one operation, on `cuda_stream`.
  Status Issue(const OpDesc& desc, const std::string& name, void* scratch, device::Stream& stream,
               cudaStream_t cuda_stream);
  void Watch();

  device::Device& device_;
  const ncclComm_t comm_;
  const int rank_;
  const int world_;
  const int ordinal_;
  const std::chrono::milliseconds timeout_;
  TraceRecorder* const trace_;
  const uint32_t track_;
  void* const barrier_buffer_;  // one fp32 on the device: a barrier is an all-reduce of it
  const std::shared_ptr<NcclWatch> watch_;

  const CollectiveOptions options_;
  std::mutex mu_;  // serialises NCCL calls on comm_ (enqueues, abort, destruction)
  uint64_t seq_ = 0;
  bool aborted_ = false;
  std::thread watchdog_;
};

Result<std::unique_ptr<Collective>> NcclCollective::Split(int color, int key) {
  STRATA_RETURN_IF_ERROR(ValidateSplit("nccl", color));
  const auto deadline = Clock::now() + timeout_;
  const std::string context = fmt::format("nccl split (rank {} of {}, color {})", rank_, world_,
                                          color);
  ncclComm_t sub = nullptr;
  {
    std::lock_guard lock(mu_);
    STRATA_RETURN_IF_ERROR(watch_->Failure());
    STRATA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice", context));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // As at start: the call completes before `sub` is read.
    const ncclResult_t started = ncclCommSplit(comm_, color, key, &sub, &config);
    const Status split = Settle(started, "ncclCommSplit", context, sub, deadline);
    if (!split.ok()) {
      if (sub != nullptr) (void)ncclCommAbort(sub);
      return split;
    }
  }
  int sub_rank = 0;
  int sub_world = 1;
  STRATA_RETURN_IF_ERROR(NcclStatus(ncclCommUserRank(sub, &sub_rank), "ncclCommUserRank", context,
                                    sub));
  STRATA_RETURN_IF_ERROR(NcclStatus(ncclCommCount(sub, &sub_world), "ncclCommCount", context, sub));
  return StartNcclCollective(device_, options_, sub, sub_rank, sub_world, ordinal_);
}

Status NcclCollective::Run(const OpDesc& desc, device::Stream& stream) {
  STRATA_RETURN_IF_ERROR(ValidateOp("nccl", desc, rank_, world_));
  STRATA_ASSIGN_OR_RETURN(void* native, device::NativeCudaStream(stream));
  auto* cuda_stream = static_cast<cudaStream_t>(native);
  std::lock_guard lock(mu_);
  STRATA_RETURN_IF_ERROR(watch_->Failure());
  if (IsEmpty(desc)) return Status::Ok();

  // 16-bit reductions go through fp32 scratch (see the header).
  const bool staged = desc.dtype != device::DType::kF32 &&
                      (desc.kind == OpKind::kAllReduce || desc.kind == OpKind::kReduceScatter);
  void* scratch = nullptr;
  if (staged) {
    const size_t elements =
        desc.kind == OpKind::kReduceScatter ? desc.count * static_cast<size_t>(world_) : desc.count;
    STRATA_ASSIGN_OR_RETURN(scratch, device_.Alloc(elements * sizeof(float)));
  }
  const uint64_t seq = ++seq_;
  const std::string name = fmt::format("nccl {}", DescribeOp(desc, seq));
  {
    std::lock_guard watch_lock(watch_->mu);
    watch_->in_flight[seq].name = name;
  }

  // Started / finished callbacks bracket the operation for the watchdog and the trace; the host
  // task after it turns a watchdog failure into the device's sticky error.
  Status status = device_.Notify(stream, [watch = watch_, seq](const Status&) {
    std::lock_guard watch_lock(watch->mu);
    auto it = watch->in_flight.find(seq);
    if (it == watch->in_flight.end()) return;
    it->second.started = true;
    it->second.start = Clock::now();
    it->second.start_ns = TraceRecorder::NowNs();
  });
  if (status.ok()) {
    status = CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice", name);
  }
  if (status.ok()) {
    status = Issue(desc, name, scratch, stream, cuda_stream);
    if (!status.ok()) watch_->Fail(status);
  }
  Status finished = device_.Notify(
      stream, [watch = watch_, seq, device = &device_, scratch, trace = trace_, track = track_,
               trace_name = TraceName(desc), bytes = OpBytes(desc, world_)](const Status&) {
        int64_t start_ns = 0;
        {
          std::lock_guard watch_lock(watch->mu);
          auto it = watch->in_flight.find(seq);
          if (it != watch->in_flight.end()) {
            start_ns = it->second.start_ns;
            watch->in_flight.erase(it);
          }
        }
        if (scratch != nullptr) device->Free(scratch);
        if (trace != nullptr) {
          const int64_t end_ns = TraceRecorder::NowNs();
          trace->Complete(
              track, trace_name, "comm", start_ns != 0 ? start_ns : end_ns, end_ns,
              {{"bytes", static_cast<double>(bytes)}, {"seq", static_cast<double>(seq)}});
        }
      });
  if (!finished.ok()) {
    // The callback will not run: forget the operation (its scratch is leaked rather than freed
    // while the stream may still use it).
    std::lock_guard watch_lock(watch_->mu);
    watch_->in_flight.erase(seq);
    if (status.ok()) status = finished;
  }
  if (!status.ok()) return status;
  return device_.HostTask(
      stream, [watch = watch_] { return watch->Failure(); }, name);
}

Status NcclCollective::Issue(const OpDesc& desc, const std::string& name, void* scratch,
                             device::Stream& stream, cudaStream_t cuda_stream) {
  const auto deadline = Clock::now() + timeout_;
  const size_t n = desc.count;
  const float scale = desc.op == ReduceOp::kAvg ? AvgScale(world_) : 1.0f;
  auto settle = [&](ncclResult_t result, std::string_view call) {
    return Settle(result, call, name, comm_, deadline);
  };
  switch (desc.kind) {
    case OpKind::kAllGather:
      return settle(
          ncclAllGather(desc.send, desc.recv, n, NcclType(desc.dtype), comm_, cuda_stream),
          "ncclAllGather");
    case OpKind::kAllToAll: {
      // One grouped send and receive per peer (NCCL has no all-to-all call of its own).
      const size_t bytes = n * device::DTypeSize(desc.dtype);
      const auto* send = static_cast<const char*>(desc.send);
      auto* recv = static_cast<char*>(desc.recv);
      STRATA_RETURN_IF_ERROR(settle(ncclGroupStart(), "ncclGroupStart"));
      ncclResult_t result = ncclSuccess;
      for (int q = 0; q < world_ && result == ncclSuccess; ++q) {
        result = ncclSend(send + static_cast<size_t>(q) * bytes, n, NcclType(desc.dtype), q,
                          comm_, cuda_stream);
        if (result == ncclSuccess) {
          result = ncclRecv(recv + static_cast<size_t>(q) * bytes, n, NcclType(desc.dtype), q,
                            comm_, cuda_stream);
        }
      }
      const ncclResult_t ended = ncclGroupEnd();
      STRATA_RETURN_IF_ERROR(settle(result, "ncclSend / ncclRecv"));
      return settle(ended, "ncclGroupEnd");
    }
    case OpKind::kBroadcast:
      return settle(
          ncclBroadcast(desc.recv, desc.recv, n, ncclUint8, desc.root, comm_, cuda_stream),
          "ncclBroadcast");
    case OpKind::kBarrier:
      return settle(ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat32, ncclSum, comm_,
                                  cuda_stream),
                    "ncclAllReduce (barrier)");
    case OpKind::kAllReduce:
      if (scratch == nullptr) {
        STRATA_RETURN_IF_ERROR(settle(ncclAllReduce(desc.send, desc.recv, n, ncclFloat32,
                                                    NcclOp(desc.op), comm_, cuda_stream),
                                      "ncclAllReduce"));
        if (scale != 1.0f) {
          STRATA_RETURN_IF_ERROR(device_.Scale(desc.recv, device::DType::kF32, scale, n, stream));
        }
        return Status::Ok();
      }
      STRATA_RETURN_IF_ERROR(
          device_.Cast(desc.send, desc.dtype, scratch, device::DType::kF32, n, stream));
      STRATA_RETURN_IF_ERROR(settle(
          ncclAllReduce(scratch, scratch, n, ncclFloat32, NcclOp(desc.op), comm_, cuda_stream),
          "ncclAllReduce"));
      if (scale != 1.0f) {
        STRATA_RETURN_IF_ERROR(device_.Scale(scratch, device::DType::kF32, scale, n, stream));
      }
      return device_.Cast(scratch, device::DType::kF32, desc.recv, desc.dtype, n, stream);
    case OpKind::kReduceScatter: {
      if (scratch == nullptr) {
        STRATA_RETURN_IF_ERROR(settle(ncclReduceScatter(desc.send, desc.recv, n, ncclFloat32,
                                                        NcclOp(desc.op), comm_, cuda_stream),
                                      "ncclReduceScatter"));
        if (scale != 1.0f) {
          STRATA_RETURN_IF_ERROR(device_.Scale(desc.recv, device::DType::kF32, scale, n, stream));
        }
        return Status::Ok();
      }
      const size_t whole = n * static_cast<size_t>(world_);
      float* mine = static_cast<float*>(scratch) + static_cast<size_t>(rank_) * n;
      STRATA_RETURN_IF_ERROR(
          device_.Cast(desc.send, desc.dtype, scratch, device::DType::kF32, whole, stream));
      STRATA_RETURN_IF_ERROR(settle(
          ncclReduceScatter(scratch, mine, n, ncclFloat32, NcclOp(desc.op), comm_, cuda_stream),
          "ncclReduceScatter"));
      if (scale != 1.0f) {
        STRATA_RETURN_IF_ERROR(device_.Scale(mine, device::DType::kF32, scale, n, stream));
      }
      return device_.Cast(mine, device::DType::kF32, desc.recv, desc.dtype, n, stream);
    }
  }
  return InternalError(fmt::format("{}: unknown operation", name));
}

void NcclCollective::Watch() {
  (void)cudaSetDevice(ordinal_);
  std::unique_lock lock(watch_->mu);
  while (!watch_->stop) {
    watch_->cv.wait_for(lock, kWatchInterval, [&] { return watch_->stop; });
    if (watch_->stop) break;
    if (watch_->failure.ok()) {
      const auto now = Clock::now();
      for (const auto& [seq, op] : watch_->in_flight) {
        if (op.started && now - op.start > timeout_) {
          watch_->failure = DeadlineExceededError(fmt::format(
              "{} on rank {}: not complete {} ms after it started; NCCL cannot tell which rank "
              "is missing (look for the rank that failed or stopped first in the others' logs)",
              op.name, rank_, timeout_.count()));
          break;
        }
      }
    }
    if (watch_->failure.ok()) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t queried = ncclCommGetAsyncError(comm_, &state);
      const ncclResult_t error = queried != ncclSuccess ? queried : state;
      if (error != ncclSuccess && error != ncclInProgress) {
        watch_->failure =
            NcclStatus(error, "ncclCommGetAsyncError", fmt::format("nccl rank {}", rank_), comm_);
      }
    }
    if (watch_->failure.ok()) continue;
    // Abort outside the watch lock (the stream callbacks take it) but under the call lock, so
    // no enqueue is inside NCCL meanwhile.
    const Status failure = watch_->failure;
    lock.unlock();
    {
      std::lock_guard call_lock(mu_);
      if (!aborted_) {
        STRATA_LOG(error, comm, "{}; aborting the NCCL communicator", failure.ToString());
        (void)ncclCommAbort(comm_);
        aborted_ = true;
      }
    }
    lock.lock();
    // Nothing more to watch: every later operation fails at enqueue.
    watch_->cv.wait(lock, [&] { return watch_->stop; });
  }
}

}  // namespace

Result<std::unique_ptr<Collective>> CreateNcclCollective(device::Device& device,
                                                         const CollectiveOptions& options,
                                                         const LaunchInfo& launch) {
  if (device.type() != device::DeviceType::kCuda) {
    return InvalidArgumentError(
        fmt::format("the nccl backend works on the cuda device; '{}' is a {} device (use mpi)",
                    device.name(), device::DeviceTypeName(device.type())));
  }
  const auto deadline = Clock::now() + options.timeout;

  // The GPU behind the device, from one of its streams.
  int ordinal = 0;
  {
    STRATA_ASSIGN_OR_RETURN(auto probe, device.CreateStream("nccl-probe"));
    STRATA_ASSIGN_OR_RETURN(void* native, device::NativeCudaStream(*probe));
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamGetDevice(static_cast<cudaStream_t>(native), &ordinal),
                   "cudaStreamGetDevice", "nccl start"));
  }
  STRATA_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice", "nccl start"));

  int rank = 0;
  int world = 1;
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (launch.world_size > 1) {
#if defined(STRATA_COMM_WITH_MPI)
    STRATA_ASSIGN_OR_RETURN(MpiRuntime * runtime, MpiRuntime::Instance(options.timeout));
    rank = runtime->rank();
    world = runtime->world_size();
    if (world != launch.world_size || rank != launch.rank) {
      return UnavailableError(fmt::format(
          "the launcher ({}) started this process as rank {} of {}, but MPI reports rank {} of "
          "{}: is this binary linked with the MPI library of the launcher that started it?",
          launch.launcher, launch.rank, launch.world_size, rank, world));
    }
    if (rank == 0) {
      STRATA_RETURN_IF_ERROR(
          NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId", "nccl start", nullptr));
    }
    auto op = std::make_shared<MpiOp>();
    op->desc = {.kind = OpKind::kBroadcast, .recv = &id, .count = sizeof(id), .root = 0};
    op->timeout = options.timeout;
    STRATA_RETURN_IF_ERROR(
        runtime->RunNow(op).WithContext("nccl start: broadcasting the unique id"));
#else
    return UnavailableError(fmt::format(
        "the nccl backend needs MPI to share its unique id among the {} ranks, and this build has "
        "no MPI",
        launch.world_size));
#endif
  } else {
    STRATA_RETURN_IF_ERROR(
        NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId", "nccl start", nullptr));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const std::string context = fmt::format("nccl start (rank {} of {})", rank, world);
  // Non-blocking: it returns ncclInProgress at once and joins the other ranks in the background.
  // The call must complete before `comm` is read: as one argument list of Settle, the order of
  // evaluation is unspecified, and GCC passed the still-null handle (seen on an H100).
  const ncclResult_t started = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  Status created = Settle(started, "ncclCommInitRankConfig", context, comm, deadline);
  if (!created.ok()) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (created.code() == StatusCode::kDeadlineExceeded) {
      return DeadlineExceededError(
          fmt::format("{}: the other ranks did not join the communicator within {} ms", context,
                      options.timeout.count()));
    }
    return UnavailableError(created.message());
  }
  return StartNcclCollective(device, options, comm, rank, world, ordinal);
}

namespace {

Result<std::unique_ptr<Collective>> StartNcclCollective(device::Device& device,
                                                        const CollectiveOptions& options,
                                                        ncclComm_t comm, int rank, int world,
                                                        int ordinal) {
  Result<void*> barrier = device.Alloc(sizeof(float));
  Status zeroed = barrier.status();
  if (zeroed.ok()) {
    zeroed = CudaStatus(cudaMemset(*barrier, 0, sizeof(float)), "cudaMemset", "nccl start");
    if (!zeroed.ok()) device.Free(*barrier);
  }
  if (!zeroed.ok()) {
    (void)ncclCommAbort(comm);
    return zeroed;
  }
  auto collective =
      std::make_unique<NcclCollective>(device, options, comm, rank, world, ordinal, *barrier);
  STRATA_RETURN_IF_ERROR(collective->Start());
  STRATA_LOG(info, comm, "nccl: rank {} of {} on GPU {} ({})", rank, world, ordinal,
             NCCL_VERSION_CODE);
  return std::unique_ptr<Collective>(std::move(collective));
}

}  // namespace

}  // namespace strata::comm::internal
