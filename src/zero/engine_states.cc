// Checkpoint states: each rank's pieces of every state, saved through a StateWriter and loaded
// through a StateReader, and the gathers behind GatherParams / GatherMaster.
#include "zero/engine_internal.h"

#include <algorithm>
#include <cstring>

namespace strata::zero {

template <typename Fn>
Status Engine::Impl::ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const {
  const auto& l = layout(u);
  const int64_t base = l.shard_offset(setup.rank);
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const ParamSlot& slot = l.slots[i];
    const int64_t lo = std::max(slot.offset, base + begin);
    const int64_t hi = std::min(slot.offset + slot.numel, base + end);
    if (lo >= hi) continue;
    STRATA_RETURN_IF_ERROR(fn(static_cast<int>(i), lo - slot.offset, hi - lo, lo - base));
  }
  return Status::Ok();
}

// ---- save ---------------------------------------------------------------------------------------

namespace {
constexpr StateKind kOptimizerKinds[3] = {StateKind::kMaster, StateKind::kExpAvg,
                                          StateKind::kExpAvgSq};
}  // namespace

// Hands elements [begin, end) of the rank's shard of unit u, at `base` in `dtype`, to `write`
// piece by piece.
Status Engine::Impl::EmitPieces(int u, const StateWriter& write, StateKind kind, int64_t begin,
                                int64_t end, const char* base, DType dtype) const {
  const auto es = static_cast<int64_t>(device::DTypeSize(dtype));
  return ForEachPiece(u, begin, end, [&](int slot, int64_t off, int64_t count, int64_t rel) {
    return write(StatePiece{u, slot, kind, off, count}, base + (rel - begin) * es, dtype);
  });
}

Status Engine::Impl::SaveUnitStates(int u, const StateWriter& write) {
  const int64_t shard = layout(u).shard_numel;
  {
    std::vector<char> shard_params(setup.shard_bytes(u));
    STRATA_RETURN_IF_ERROR(params.ReadShard(u, shard_params.data()));
    STRATA_RETURN_IF_ERROR(EmitPieces(u, write, StateKind::kParams, 0, shard,
                                shard_params.data(), setup.compute_dtype));
  }
  if (setup.is_frozen(u)) return Status::Ok();  // no optimizer state
  return SaveOptimizerStates(u, write);
}

// Master, exp_avg and exp_avg_sq of unit u: from the device, or one offloaded sub-group at a time
// (an NVMe-homed shard is never held whole in host memory).
Status Engine::Impl::SaveOptimizerStates(int u, const StateWriter& write) {
  const auto& l = layout(u);
  const int64_t shard = l.shard_numel;
  if (!setup.on_cpu(u)) {
    const int64_t first = setup.stage == 0 ? l.shard_offset(setup.rank) : 0;
    void* const states[3] = {adam.master(u), adam.exp_avg(u), adam.exp_avg_sq(u)};
    std::vector<float> host(static_cast<size_t>(shard));
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(device.CopyAsync(host.data(), static_cast<const float*>(states[k]) + first,
                                              host.size() * 4, device::CopyKind::kDeviceToHost,
                                              *streams.comm));
      STRATA_RETURN_IF_ERROR(device.Synchronize(*streams.comm));
      STRATA_RETURN_IF_ERROR(EmitPieces(u, write, kOptimizerKinds[k], 0, shard,
                                  reinterpret_cast<const char*>(host.data()), DType::kF32));
    }
    return Status::Ok();
  }
  for (const SubGroup& g : adam.groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, adam.offloaded().Acquire(g, Access::kRead, "checkpoint"));
    const char* base = static_cast<const char*>(lease.data());
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(EmitPieces(u, write, kOptimizerKinds[k], g.offset,
                                  g.offset + g.numel, base + k * g.numel * 4, DType::kF32));
    }
  }
  return Status::Ok();
}

// ---- load ---------------------------------------------------------------------------------------

Status Engine::Impl::LoadUnitStates(int u, const InitialStates& initial) {
  if (!initial.read) return InvalidArgumentError("engine: loading states needs a reader");
  if (setup.is_frozen(u)) return LoadFrozenUnit(u, initial);
  const auto& l = layout(u);
  const size_t shard = static_cast<size_t>(l.shard_numel);
  // The rank's shard of each state; alignment gaps and padding stay zero.
  std::vector<float> master(shard, 0.0f), m, v;
  auto fill = [&](StateKind kind, std::vector<float>& out) {
    return ForEachPiece(u, 0, l.shard_numel, [&](int slot, int64_t off, int64_t count, int64_t rel) {
      return initial.read(StatePiece{u, slot, kind, off, count}, out.data() + rel, DType::kF32);
    });
  };
  STRATA_RETURN_IF_ERROR(
      fill(initial.with_optimizer ? StateKind::kMaster : StateKind::kParams, master));
  // Without saved moments (fine-tuning from a model directory) they start at zero, written
  // in place: set-up then holds the master shard and its cast, not two more fp32 shards.
  const bool moments = initial.with_optimizer;
  if (moments) {
    m.assign(shard, 0.0f);
    v.assign(shard, 0.0f);
    STRATA_RETURN_IF_ERROR(fill(StateKind::kExpAvg, m));
    STRATA_RETURN_IF_ERROR(fill(StateKind::kExpAvgSq, v));
  }
  // Parameters: the master weights in the compute dtype (what the optimizer's fused copy writes).
  {
    std::vector<char> cast(shard * setup.compute_bytes);
    device::ConvertHost(master.data(), DType::kF32, cast.data(), setup.compute_dtype, shard);
    STRATA_RETURN_IF_ERROR(params.StoreShard(u, cast.data()));
  }
  return PutOptimizerStates(u, master, m, v, moments);
}

// A frozen unit has no master weights and no optimizer state: its parameters are read as they
// were saved, straight into the compute dtype (the reader rounds as ConvertHost does), so
// loading a frozen 70B-shaped layer holds one shard in 16 bits, not four in fp32.
Status Engine::Impl::LoadFrozenUnit(int u, const InitialStates& initial) {
  const auto& l = layout(u);
  const size_t element = setup.compute_bytes;
  std::vector<char> cast(static_cast<size_t>(l.shard_numel) * element, 0);
  STRATA_RETURN_IF_ERROR(
      ForEachPiece(u, 0, l.shard_numel, [&](int slot, int64_t off, int64_t count, int64_t rel) {
        return initial.read(StatePiece{u, slot, StateKind::kParams, off, count},
                            cast.data() + static_cast<size_t>(rel) * element,
                            setup.compute_dtype);
      }));
  return params.StoreShard(u, cast.data());
}

// Unit u's loaded master weights and moments (the rank's shard; `moments` false: zero) into its
// optimizer states, on the device (all-gathered at stage 0, where every rank keeps every state)
// or in its offloaded sub-groups.
Status Engine::Impl::PutOptimizerStates(int u, const std::vector<float>& master,
                                        const std::vector<float>& m, const std::vector<float>& v,
                                        bool moments) {
  const auto& l = layout(u);
  const size_t shard = static_cast<size_t>(l.shard_numel);
  const std::vector<float>* const states[3] = {&master, &m, &v};
  device::Stream& comm = *streams.comm;
  if (!setup.on_cpu(u)) {
    void* const buffers[3] = {adam.master(u), adam.exp_avg(u), adam.exp_avg_sq(u)};
    for (int k = 0; k < 3; ++k) {
      if (k > 0 && !moments) {
        const size_t n = setup.stage == 0 ? static_cast<size_t>(l.padded_numel()) : shard;
        STRATA_RETURN_IF_ERROR(device.Fill(buffers[k], DType::kF32, 0.0f, n, comm));
        STRATA_RETURN_IF_ERROR(device.Synchronize(comm));
        continue;
      }
      float* own = static_cast<float*>(buffers[k]) + (setup.stage == 0 ? l.shard_offset(setup.rank) : 0);
      STRATA_RETURN_IF_ERROR(device.CopyAsync(own, states[k]->data(), shard * 4,
                                              device::CopyKind::kHostToDevice, comm));
      if (setup.stage == 0) {  // every rank keeps every state
        STRATA_RETURN_IF_ERROR(
            collective.AllGather(own, buffers[k], l.shard_numel, DType::kF32, comm));
      }
      STRATA_RETURN_IF_ERROR(device.Synchronize(comm));
    }
    return Status::Ok();
  }
  for (const SubGroup& g : adam.groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            adam.offloaded().Acquire(g, Access::kOverwrite, "checkpoint load"));
    auto* p = static_cast<float*>(lease.data());
    std::memcpy(p, master.data() + g.offset, static_cast<size_t>(g.numel) * 4);
    for (int k = 1; k < 3; ++k) {
      if (moments) {
        std::memcpy(p + k * g.numel, states[k]->data() + g.offset,
                    static_cast<size_t>(g.numel) * 4);
      } else {
        std::memset(p + k * g.numel, 0, static_cast<size_t>(g.numel) * 4);
      }
    }
    lease.Release(true);
  }
  return adam.TakeWritebackError();
}

// ---- gathering for tests and checkpoints --------------------------------------------------------

// All-gathers each rank's shard (host memory, `dtype`) of unit u and returns the unit in fp32.
Result<std::vector<float>> Engine::Impl::GatherShards(int u, const void* own_shard_host,
                                                      DType dtype) {
  const auto& l = layout(u);
  const size_t es = device::DTypeSize(dtype);
  const size_t shard = static_cast<size_t>(l.shard_numel);
  const size_t padded = static_cast<size_t>(l.padded_numel());
  device::Stream& comm = *streams.comm;
  STRATA_ASSIGN_OR_RETURN(void* buf, device.Alloc(padded * es));
  std::vector<char> host(padded * es);
  char* own = static_cast<char*>(buf) + l.shard_offset(setup.rank) * es;
  Status st = device.CopyAsync(own, own_shard_host, shard * es, device::CopyKind::kHostToDevice,
                               comm);
  if (st.ok()) st = collective.AllGather(own, buf, shard, dtype, comm);
  if (st.ok()) {
    st = device.CopyAsync(host.data(), buf, host.size(), device::CopyKind::kDeviceToHost, comm);
  }
  if (st.ok()) st = device.Synchronize(comm);
  device.Free(buf);
  STRATA_RETURN_IF_ERROR(st);
  std::vector<float> out(static_cast<size_t>(l.used_numel));
  device::ConvertHost(host.data(), dtype, out.data(), DType::kF32, out.size());
  return out;
}

}  // namespace strata::zero
