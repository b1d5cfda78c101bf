#include "zero/engine_internal.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace strata::zero {

// ---- checkpoint states ---------------------------------------------------------------------------

// Unit u's parameter shard (stage 3), in the compute dtype, into host memory.
Status Engine::Impl::ReadParamShard(int u, void* host_dst) {
  const uint64_t bytes = static_cast<uint64_t>(layouts[u].shard_numel) * csz;
  if (stage <= 2) {
    const char* own = static_cast<const char*>(full_params[u]) + layouts[u].shard_offset(rank) * csz;
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(host_dst, own, bytes, device::CopyKind::kDeviceToHost,
                                         *comm_stream));
    return dev.Synchronize(*comm_stream);
  }
  if (param_home == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, ptm->Acquire(u, Tier::kDevice, Access::kRead, "checkpoint"));
    STRATA_RETURN_IF_ERROR(dev.CopyAsync(host_dst, lease.data(), bytes,
                                         device::CopyKind::kDeviceToHost, *comm_stream));
    return dev.Synchronize(*comm_stream);
  }
  STRATA_ASSIGN_OR_RETURN(Lease lease, ptm->Acquire(u, Tier::kHost, Access::kRead, "checkpoint"));
  std::memcpy(host_dst, lease.data(), bytes);
  return Status::Ok();
}

template <typename Fn>
Status Engine::Impl::ForEachPiece(int u, int64_t begin, int64_t end, Fn&& fn) const {
  const auto& l = layouts[u];
  const int64_t base = l.shard_offset(rank);
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const ParamSlot& slot = l.slots[i];
    const int64_t lo = std::max(slot.offset, base + begin);
    const int64_t hi = std::min(slot.offset + slot.numel, base + end);
    if (lo >= hi) continue;
    STRATA_RETURN_IF_ERROR(fn(static_cast<int>(i), lo - slot.offset, hi - lo, lo - base));
  }
  return Status::Ok();
}

Status Engine::Impl::SaveUnitStates(int u, const StateWriter& write) {
  const auto& l = layouts[u];
  const int64_t shard = l.shard_numel;
  auto emit = [&](StateKind kind, int64_t begin, int64_t end, const char* base, DType dtype) {
    const size_t es = device::DTypeSize(dtype);
    return ForEachPiece(u, begin, end, [&](int slot, int64_t off, int64_t count, int64_t rel) {
      return write(StatePiece{u, slot, kind, off, count}, base + (rel - begin) * static_cast<int64_t>(es),
                   dtype);
    });
  };
  {
    std::vector<char> params(static_cast<size_t>(shard) * csz);
    STRATA_RETURN_IF_ERROR(ReadParamShard(u, params.data()));
    STRATA_RETURN_IF_ERROR(emit(StateKind::kParams, 0, shard, params.data(), cdt));
  }
  if (frozen[u]) return Status::Ok();  // no optimizer state
  const StateKind kinds[3] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
  if (!cpu_unit[u]) {
    const int64_t first = stage == 0 ? l.shard_offset(rank) : 0;
    void* const bufs[3] = {master_dev[u], m_dev[u], v_dev[u]};
    std::vector<float> host(static_cast<size_t>(shard));
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(host.data(), static_cast<const float*>(bufs[k]) + first,
                                           host.size() * 4, device::CopyKind::kDeviceToHost,
                                           *comm_stream));
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
      STRATA_RETURN_IF_ERROR(emit(kinds[k], 0, shard, reinterpret_cast<const char*>(host.data()),
                                  DType::kF32));
    }
    return Status::Ok();
  }
  // One sub-group at a time: an NVMe-homed shard is never held whole in host memory.
  for (const SubGroup& g : ostates->groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, ostates->Acquire(g, Access::kRead, "checkpoint"));
    const char* base = static_cast<const char*>(lease.data());
    for (int k = 0; k < 3; ++k) {
      STRATA_RETURN_IF_ERROR(emit(kinds[k], g.offset, g.offset + g.numel, base + k * g.numel * 4,
                                  DType::kF32));
    }
  }
  return Status::Ok();
}

// Puts the rank's shard of unit u's parameters (host memory, compute dtype) in place: into the
// full copy every rank keeps (stages 0-2, all-gathered) or into the shard's home (stage 3).
Status Engine::Impl::StoreParamShard(int u, const char* shard_cdt) {
  const auto& l = layouts[u];
  if (stage >= 3) return WriteParamShard(u, shard_cdt);
  char* own = static_cast<char*>(full_params[u]) + l.shard_offset(rank) * csz;
  STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, shard_cdt, static_cast<size_t>(l.shard_numel) * csz,
                                       device::CopyKind::kHostToDevice, *comm_stream));
  STRATA_RETURN_IF_ERROR(comm.AllGather(own, full_params[u], l.shard_numel, cdt, *comm_stream));
  return dev.Synchronize(*comm_stream);
}

Status Engine::Impl::LoadUnitStates(int u, const InitialStates& initial) {
  if (!initial.read) return InvalidArgumentError("engine: loading states needs a reader");
  const auto& l = layouts[u];
  const size_t shard = static_cast<size_t>(l.shard_numel);
  // The rank's shard of each state; alignment gaps and padding stay zero.
  if (frozen[u]) {
    // A frozen unit has no master weights and no optimizer state: its parameters are read as
    // they were saved, straight into the compute dtype (the reader rounds as ConvertHost does),
    // so loading a frozen 70B-shaped layer holds one shard in 16 bits, not four in fp32.
    std::vector<char> cast(shard * csz, 0);
    STRATA_RETURN_IF_ERROR(
        ForEachPiece(u, 0, l.shard_numel, [&](int slot, int64_t off, int64_t count, int64_t rel) {
          return initial.read(StatePiece{u, slot, StateKind::kParams, off, count},
                              cast.data() + static_cast<size_t>(rel) * csz, cdt);
        }));
    return StoreParamShard(u, cast.data());
  }
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
    std::vector<char> cast(shard * csz);
    device::ConvertHost(master.data(), DType::kF32, cast.data(), cdt, shard);
    STRATA_RETURN_IF_ERROR(StoreParamShard(u, cast.data()));
  }
  const std::vector<float>* const states[3] = {&master, &m, &v};
  if (!cpu_unit[u]) {
    void* const bufs[3] = {master_dev[u], m_dev[u], v_dev[u]};
    for (int k = 0; k < 3; ++k) {
      if (k > 0 && !moments) {
        const size_t n = stage == 0 ? static_cast<size_t>(l.padded_numel()) : shard;
        STRATA_RETURN_IF_ERROR(dev.Fill(bufs[k], DType::kF32, 0.0f, n, *comm_stream));
        STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
        continue;
      }
      float* own = static_cast<float*>(bufs[k]) + (stage == 0 ? l.shard_offset(rank) : 0);
      STRATA_RETURN_IF_ERROR(dev.CopyAsync(own, states[k]->data(), shard * 4,
                                           device::CopyKind::kHostToDevice, *comm_stream));
      if (stage == 0) {  // every rank keeps every state
        STRATA_RETURN_IF_ERROR(comm.AllGather(own, bufs[k], l.shard_numel, DType::kF32, *comm_stream));
      }
      STRATA_RETURN_IF_ERROR(dev.Synchronize(*comm_stream));
    }
    return Status::Ok();
  }
  for (const SubGroup& g : ostates->groups(u)) {
    STRATA_ASSIGN_OR_RETURN(Lease lease,
                            ostates->Acquire(g, Access::kOverwrite, "checkpoint load"));
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
  return ostates->TakeWritebackError();
}

// ---- gathering for tests and checkpoints --------------------------------------------------------

// All-gathers each rank's shard (host memory, `dtype`) of unit u and returns the unit in fp32.
Result<std::vector<float>> Engine::Impl::GatherShards(int u, const void* own_shard_host,
                                                      DType dtype) {
  const auto& l = layouts[u];
  const size_t es = device::DTypeSize(dtype);
  const size_t shard = static_cast<size_t>(l.shard_numel);
  const size_t padded = static_cast<size_t>(l.padded_numel());
  STRATA_ASSIGN_OR_RETURN(void* buf, dev.Alloc(padded * es));
  std::vector<char> host(padded * es);
  char* own = static_cast<char*>(buf) + l.shard_offset(rank) * es;
  Status st = dev.CopyAsync(own, own_shard_host, shard * es, device::CopyKind::kHostToDevice,
                            *comm_stream);
  if (st.ok()) st = comm.AllGather(own, buf, shard, dtype, *comm_stream);
  if (st.ok()) {
    st = dev.CopyAsync(host.data(), buf, host.size(), device::CopyKind::kDeviceToHost,
                       *comm_stream);
  }
  if (st.ok()) st = dev.Synchronize(*comm_stream);
  dev.Free(buf);
  STRATA_RETURN_IF_ERROR(st);
  std::vector<float> out(static_cast<size_t>(l.used_numel));
  device::ConvertHost(host.data(), dtype, out.data(), DType::kF32, out.size());
  return out;
}


}  // namespace strata::zero
