// Collective: Strata's seam to the other data-parallel ranks (all-gather, reduce-scatter,
// all-reduce, all-to-all, broadcast, barrier on device buffers, in stream order).
//
// Three backends implement it (see CreateCollective):
//   single  world size 1: every operation is a device-side copy (or nothing). Runs anywhere.
//   mpi     OpenMPI (or any MPI-3 library) for the CPU device: ranks are processes started by
//           mpirun / srun; buffers are host memory.
//   nccl    NCCL for the CUDA device; its unique id is broadcast over MPI.
// A fourth, for tests, is not made by CreateCollective: in-process, N ranks that are threads of
// one process, each with its own CPU device (comm/in_process_collective.h), with the MPI
// backend's results bit for bit.
//
// Ordering: an operation enqueued on `stream` starts after the work enqueued on that stream
// before it, and work enqueued on `stream` after it waits for it — exactly like a copy. Every rank
// must enqueue the same collectives in the same order (as with MPI and NCCL); a backend runs them
// in enqueue order, whatever streams they were enqueued on.
//
// Buffers: `count` is in elements of `dtype`; AllGather, ReduceScatter and AllToAll take `count` =
// elements per rank (recv / send holds world_size * count elements, rank r's part at offset r * count).
// In-place use is allowed where stated. Reductions of bf16 / fp16 add in fp32 and round once.
// kAvg is that fp32 sum times 1.0f / world_size (the reciprocal rounded to fp32), rounded once
// to the dtype, on every backend (the order of the fp32 additions is the backend's; docs/comm.md).
//
// Errors: arguments are checked at enqueue (InvalidArgument at once). A failure while the
// operation runs — a backend error, a peer that stopped answering — becomes the device's sticky
// error (returned by the next Synchronize of any stream, see device.h), and every later operation
// of this Collective fails with the same error. A peer that does not take part within
// `CollectiveOptions::timeout` is DeadlineExceeded, naming the operation, its sequence number
// and the rank(s) that did not arrive (when the backend can tell; MPI can) — never a hang.
//
// Threading: every method may be called from any thread; operations run on backend-owned
// threads. The Collective must outlive the work enqueued with it and be destroyed before the
// Device.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "strata/device.h"
#include "strata/status.h"

namespace strata {
class TraceRecorder;
}

namespace strata::comm {

// kMax: the largest value over ranks, exact in every dtype (NaN where any rank's is NaN).
enum class ReduceOp : uint8_t { kSum, kAvg, kMax };
std::string_view ReduceOpName(ReduceOp op);  // "sum", "avg", "max"

enum class Backend : uint8_t { kAuto, kSingle, kMpi, kNccl, kInProcess };
// "auto", "single", "mpi", "nccl", "in-process"
std::string_view BackendName(Backend backend);

struct CollectiveOptions {
  // kAuto: kSingle when the launcher says world size 1 (or nothing), else kMpi for the CPU device
  // and kNccl for the CUDA device.
  Backend backend = Backend::kAuto;
  // How long one operation may wait for the other ranks before it fails (DeadlineExceeded).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // When set, every operation is recorded on a track "comm" (start and end as run). Must outlive
  // the Collective.
  TraceRecorder* trace = nullptr;
};

// Rank and world size as the launcher set them (OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE,
// SLURM_PROCID/NTASKS); {0, 1} when none is set.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // rank within the node (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID)
  // Ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE);
  // world_size when the launcher does not say.
  int local_size = 1;
  std::string launcher;  // "mpirun", "srun", "pmi" or "none"
};
LaunchInfo DetectLaunch();

class Collective {
 public:
  virtual ~Collective() = default;
  Collective() = default;
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;

  virtual Backend backend() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // recv[r * count + i] = rank r's send[i]. send may be recv + rank() * count (in place).
  virtual Status AllGather(const void* send, void* recv, size_t count, device::DType dtype,
                           device::Stream& stream) = 0;
  // recv[i] = op over ranks r of (rank r's send[rank() * count + i]). recv may equal
  // send + rank() * count (in place).
  virtual Status ReduceScatter(const void* send, void* recv, size_t count, device::DType dtype,
                               ReduceOp op, device::Stream& stream) = 0;
  // recv[i] = op over ranks of send[i]; send may equal recv. Every rank gets the same bits.
  virtual Status AllReduce(const void* send, void* recv, size_t count, device::DType dtype,
                           ReduceOp op, device::Stream& stream) = 0;
  // recv[q * count + i] = rank q's send[rank() * count + i]: every rank sends its q-th part to
  // rank q. send and recv hold world_size * count elements each and must not overlap.
  virtual Status AllToAll(const void* send, void* recv, size_t count, device::DType dtype,
                          device::Stream& stream) = 0;
  // Every rank's buf receives root's `bytes` bytes.
  virtual Status Broadcast(void* buf, size_t bytes, int root, device::Stream& stream) = 0;
  // Work after it on `stream` starts only after every rank reached it.
  virtual Status Barrier(device::Stream& stream) = 0;

  // A collective over the ranks of this one that pass the same `color` (>= 0), ranked by `key`
  // (ties by rank here): the sub-groups of a run (the ranks of a node, the same local rank across
  // nodes, the tensor- and data-parallel groups; comm/topology.h). Every rank of this collective
  // calls it, in the same order relative to its other operations; the call blocks until every
  // rank has, and fails with DeadlineExceeded (naming the ranks that did not) after the timeout.
  // The new collective has this one's device, backend and timeout; its operations are ordered
  // with this one's as the backend orders operations (MPI: one sequence over every group of the
  // process; in-process and NCCL: one sequence per group). A failure of one group does not fail
  // the other at once: its ranks learn it when the failed rank leaves, or by the timeout.
  // The new collective must be destroyed before this one.
  virtual Result<std::unique_ptr<Collective>> Split(int color, int key) = 0;
};

// Creates the backend for `device` (which must outlive it). For MPI and NCCL this initialises MPI
// (once per process; MPI_Finalize runs at exit). Errors: Unimplemented for a backend not built
// in; InvalidArgument for a backend that does not fit the device (mpi with cuda, nccl with cpu)
// and for kInProcess (its ranks join an InProcessWorld instead);
// Unavailable when the launcher's world size is > 1 but the backend cannot start.
Result<std::unique_ptr<Collective>> CreateCollective(device::Device& device,
                                                     const CollectiveOptions& options);

}  // namespace strata::comm
