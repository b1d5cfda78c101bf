// What the Collective backends share: one plain description of an operation (OpDesc), its
// argument checks, its name in messages and traces, and the host loops that stage 16-bit values
// through fp32 for a reduction.
//
// The arithmetic contract, the same on every backend:
//   - sum: the fp32 sum over ranks (in an order the backend chooses), rounded once to `dtype`.
//   - avg: that fp32 sum times kAvgScale(world) = 1.0f / world (the reciprocal rounded to fp32),
//     then rounded once to `dtype`. With world size 1 both are the identity.
// 16-bit inputs are widened to fp32 exactly, so a bf16 / fp16 reduction rounds exactly once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/collective.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::comm::internal {

enum class OpKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kAllToAll,
  kBroadcast,
  kBarrier
};
std::string_view OpKindName(OpKind kind);  // "all-gather", "reduce-scatter", "all-to-all", ...

// One collective call's arguments, exactly as the caller gave them.
struct OpDesc {
  OpKind kind = OpKind::kBarrier;
  const void* send = nullptr;  // AllGather, ReduceScatter, AllReduce
  void* recv = nullptr;        // AllGather, ReduceScatter, AllReduce; Broadcast's buffer
  size_t count = 0;  // elements (per rank for AllGather / ReduceScatter / AllToAll); bytes for
                     // Broadcast
  device::DType dtype = device::DType::kF32;  // not used by Broadcast and Barrier
  ReduceOp op = ReduceOp::kSum;               // ReduceScatter and AllReduce
  int root = 0;                               // Broadcast
};

// InvalidArgument (naming `backend`, the operation and the argument) unless the arguments fit
// the contract of strata/collective.h for a world of `world` ranks of which this is `rank`:
// known dtype and op, non-null and dtype-aligned buffers when count > 0, no size overflow, a
// root in [0, world), and buffers that are either disjoint or exactly in place:
//   AllGather      send == recv + rank * count
//   ReduceScatter  recv == send + rank * count
//   AllReduce      send == recv
// (AllToAll has no in-place form: its buffers must be disjoint.)
Status ValidateOp(std::string_view backend, const OpDesc& desc, int rank, int world);

// True when the operation moves no data (count 0; Barrier is never empty).
bool IsEmpty(const OpDesc& desc);
// True for the in-place forms listed above.
bool IsInPlace(const OpDesc& desc, int rank);

// "all-reduce #12 (1000003 x bf16, avg)", "broadcast #3 (4096 B from rank 1)", "barrier #7".
std::string DescribeOp(const OpDesc& desc, uint64_t seq);

// The name of the operation's trace event: "all-reduce bf16", "broadcast", "barrier" (the
// sequence number and size go into the event's arguments).
std::string TraceName(const OpDesc& desc);

// The bytes an operation touches in its largest buffer (the number traces report): the gathered
// or scattered whole for AllGather / ReduceScatter, the buffer for AllReduce / Broadcast, 0 for
// Barrier.
uint64_t OpBytes(const OpDesc& desc, int world);

// Collective::Split's arguments, checked the same way by every backend: InvalidArgument naming
// `backend` for a negative color.
Status ValidateSplit(std::string_view backend, int color);

// Where a rank lands in a split, from every rank's (color, key) in rank order: the ranks of its
// color ordered by (key, rank), its place among them, and how many there are.
struct SplitPlace {
  std::vector<int> members;  // ranks of the parent, in the new rank order
  int rank = 0;              // this rank's place in `members`
  int size() const { return static_cast<int>(members.size()); }
};
SplitPlace PlaceInSplit(const std::vector<std::pair<int, int>>& color_key, int rank);

// 1.0f / world, the factor of kAvg.
inline float AvgScale(int world) {
  return 1.0f / static_cast<float>(world);
}

// dst[i] = fp32 value of src[i] (src of `dtype`).
void WidenToF32(const void* src, device::DType dtype, float* dst, size_t n);
// dst[i] = src[i] * scale rounded to `dtype` (scale 1.0f leaves fp32 values untouched).
void NarrowFromF32(const float* src, float scale, void* dst, device::DType dtype, size_t n);

// out[i] = `op` over src[0][i], src[1][i], ..., src[world - 1][i] for i < n: the sources, of
// `dtype`, widened to fp32, combined in exactly that order (rank order), and rounded once to
// `dtype`. kSum adds; kAvg adds, then scales by AvgScale(world); kMax keeps the largest (exact;
// NaN where any source is NaN). The reduction of every backend that reduces on the host (mpi,
// in-process), so that they give the same bits. Block by block, so `out` may be one of the
// sources (each block of the sources is read before that block of `out` is written).
void ReduceInRankOrder(const std::byte* const* src, size_t world, device::DType dtype,
                       ReduceOp op, std::byte* out, size_t n);

// A Collective whose six operations are one OpDesc each, run by `Run` (every backend).
class OpCollective : public Collective {
 public:
  Status AllGather(const void* send, void* recv, size_t count, device::DType dtype,
                   device::Stream& stream) final {
    return Run(
        {.kind = OpKind::kAllGather, .send = send, .recv = recv, .count = count, .dtype = dtype},
        stream);
  }
  Status ReduceScatter(const void* send, void* recv, size_t count, device::DType dtype, ReduceOp op,
                       device::Stream& stream) final {
    return Run({.kind = OpKind::kReduceScatter,
                .send = send,
                .recv = recv,
                .count = count,
                .dtype = dtype,
                .op = op},
               stream);
  }
  Status AllReduce(const void* send, void* recv, size_t count, device::DType dtype, ReduceOp op,
                   device::Stream& stream) final {
    return Run({.kind = OpKind::kAllReduce,
                .send = send,
                .recv = recv,
                .count = count,
                .dtype = dtype,
                .op = op},
               stream);
  }
  Status AllToAll(const void* send, void* recv, size_t count, device::DType dtype,
                  device::Stream& stream) final {
    return Run(
        {.kind = OpKind::kAllToAll, .send = send, .recv = recv, .count = count, .dtype = dtype},
        stream);
  }
  Status Broadcast(void* buf, size_t bytes, int root, device::Stream& stream) final {
    return Run({.kind = OpKind::kBroadcast, .recv = buf, .count = bytes, .root = root}, stream);
  }
  Status Barrier(device::Stream& stream) final { return Run({.kind = OpKind::kBarrier}, stream); }

 protected:
  // Checks and enqueues one operation on `stream` (see strata/collective.h for the contract).
  virtual Status Run(const OpDesc& desc, device::Stream& stream) = 0;
};

}  // namespace strata::comm::internal
