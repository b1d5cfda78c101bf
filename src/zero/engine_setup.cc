#include "zero/engine_setup.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"

namespace strata::zero::engine_internal {

Placement PlacementOf(const Config& cfg) {
  Placement p;
  p.stage = cfg.zero.stage;
  p.compute_bytes = device::DTypeSize(ComputeDType(cfg));
  p.param_home = p.stage == 3 ? HomeOf(cfg.zero.offload_param.device) : Tier::kDevice;
  p.optim_home = p.stage == 0 ? Tier::kDevice : HomeOf(cfg.zero.offload_optimizer.device);
  return p;
}

namespace {

Status CheckOptions(const EngineOptions& options) {
  if (options.cpu_adam_threads < 1) {
    return InvalidArgumentError(
        fmt::format("engine: cpu_adam_threads is {}; expected >= 1", options.cpu_adam_threads));
  }
  if (options.optimizer_pipeline_depth < 3) {
    return InvalidArgumentError(fmt::format(
        "engine: optimizer_pipeline_depth is {}; expected >= 3 (read-ahead, current, "
        "write-behind)",
        options.optimizer_pipeline_depth));
  }
  return Status::Ok();
}

// offload_optimizer.ratio below half of the last trainable unit's share selects no unit.
void WarnIfRatioOffloadsNothing(const Config& cfg, const EngineSetup& s) {
  int64_t total = 0, last = 0;
  for (int u = 0; u < s.units(); ++u) {
    if (s.is_frozen(u)) continue;
    total += s.layouts[static_cast<size_t>(u)].shard_numel;
    last = s.layouts[static_cast<size_t>(u)].shard_numel;
  }
  STRATA_LOG(warn, zero,
             "offload_optimizer.ratio {:g} offloads no unit (the engine offloads whole units; "
             "the smallest ratio that takes the last one is {:.3g}): every optimizer state "
             "stays on the device",
             cfg.zero.offload_optimizer.ratio,
             0.5 * static_cast<double>(last) / static_cast<double>(std::max<int64_t>(total, 1)));
}

// Which units the CPU optimizer updates, and whether it overlaps backward and streams the
// gradient shards.
void ChooseOptimizers(const Config& cfg, const EngineOptions& options, EngineSetup& s) {
  s.cpu_optimizer_unit = CpuOptimizerUnits(cfg, s.layouts, s.frozen);
  s.cpu_optimizer =
      std::count(s.cpu_optimizer_unit.begin(), s.cpu_optimizer_unit.end(), 1) > 0;
  s.device_optimizer = false;
  for (int u = 0; u < s.units(); ++u) s.device_optimizer |= !s.on_cpu(u) && !s.is_frozen(u);
  if (s.optim_home != Tier::kDevice && !s.cpu_optimizer && s.device_optimizer && s.rank == 0) {
    WarnIfRatioOffloadsNothing(cfg, s);
  }
  // The CPU optimizer overlaps backward only when an update never depends on the global gradient
  // norm: no clipping, no fp16 overflow skipping, no skipping of non-finite steps.
  s.overlapped_optimizer = s.cpu_optimizer && options.overlap_optimizer && OverlapsOptimizer(cfg);
  s.stream_grad_shards =
      s.overlapped_optimizer && StreamsGradShards(cfg, s.world_size, options.overlap_optimizer);
}

// The pinned pool, the block store and the NVMe paths the homes need.
Status CheckOffloadResources(const Config& cfg, const EngineOptions& options, EngineSetup& s) {
  const bool needs_pool = s.cpu_optimizer || s.param_home != Tier::kDevice;
  if (needs_pool && options.pool == nullptr) {
    return InvalidArgumentError(
        "engine: offload to cpu or nvme needs a pinned pool (EngineOptions::pool)");
  }
  const bool needs_nvme =
      s.param_home == Tier::kNvme || (s.cpu_optimizer && s.optim_home == Tier::kNvme);
  s.nvme_paths = options.nvme_paths;
  if (s.nvme_paths.empty()) s.nvme_paths = cfg.strata.io.nvme_paths;
  if (needs_nvme && (options.store == nullptr || s.nvme_paths.empty())) {
    return InvalidArgumentError(
        "engine: NVMe offload needs a block store and at least one NVMe path "
        "(offload_param / offload_optimizer nvme_path, or strata.io.nvme_paths)");
  }
  return Status::Ok();
}

// Model::SharedUnits and RecomputeUnits, checked: a unit may share each earlier unit once, and
// recompute earlier units that share none.
Status ResolveSharing(const Model& model, EngineSetup& s) {
  const size_t n_units = s.layouts.size();
  s.shared.resize(n_units);
  s.recompute.resize(n_units);
  for (size_t u = 0; u < n_units; ++u) {
    s.shared[u] = model.SharedUnits(static_cast<int>(u));
    for (size_t i = 0; i < s.shared[u].size(); ++i) {
      const int shared = s.shared[u][i];
      if (shared < 0 || shared >= static_cast<int>(u) ||
          std::count(s.shared[u].begin(), s.shared[u].begin() + static_cast<std::ptrdiff_t>(i),
                     shared) > 0) {
        return InvalidArgumentError(fmt::format(
            "model: unit {} ('{}') shares unit {}; a unit may share each earlier unit once", u,
            s.layouts[u].name, shared));
      }
      s.shared_live_bytes += static_cast<uint64_t>(s.layouts[shared].padded_numel()) * (4 + 8);
    }
  }
  for (size_t u = 0; u < n_units; ++u) {
    s.recompute[u] = model.RecomputeUnits(static_cast<int>(u));
    for (const int r : s.recompute[u]) {
      if (r < 0 || r >= static_cast<int>(u) || !s.shared[static_cast<size_t>(r)].empty()) {
        return InvalidArgumentError(fmt::format(
            "model: unit {} ('{}') recomputes unit {}; a unit may recompute only earlier units "
            "that share none",
            u, s.layouts[u].name, r));
      }
    }
  }
  return Status::Ok();
}

// The nodes (EngineOptions::topology; a world of one stands for one node of every rank), and
// ZeRO++'s hierarchical features on them: hpZ needs zero_hpz_partition_size to be the ranks per
// node and more than one node; qgZ needs stage 2 or 3 and more than one rank.
Status ResolveZeroPlusPlus(const Config& cfg, const EngineOptions& options, EngineSetup& s) {
  if (options.topology.world == 1 && s.world_size > 1) {
    STRATA_ASSIGN_OR_RETURN(s.topology,
                            comm::Topology::Uniform(s.rank, s.world_size, s.world_size));
  } else if (options.topology.world != s.world_size || options.topology.rank != s.rank) {
    return InvalidArgumentError(fmt::format(
        "engine: the topology is of rank {} in a world of {}, but the collective's is rank {} of "
        "{}",
        options.topology.rank, options.topology.world, s.rank, s.world_size));
  } else {
    s.topology = options.topology;
  }
  const int hpz = cfg.zero.zero_hpz_partition_size;
  if (hpz > 1 && s.stage == 3) {
    if (hpz != s.topology.ranks_per_node) {
      return InvalidArgumentError(fmt::format(
          "zero_optimization.zero_hpz_partition_size is {}, but this run's nodes hold {} "
          "rank{} each ({}): hpZ's secondary copy is sharded over the ranks of one node, so set "
          "it to {}",
          hpz, s.topology.ranks_per_node, s.topology.ranks_per_node == 1 ? "" : "s",
          s.topology.Describe(), s.topology.ranks_per_node));
    }
    if (s.topology.nodes() > 1) {
      s.hpz = hpz;
    } else if (s.rank == 0) {
      STRATA_LOG(info, zero,
                 "zero_optimization.zero_hpz_partition_size {}: one node holds every rank, so "
                 "every gather is within the node already; hpZ keeps no secondary copy",
                 hpz);
    }
  }
  s.quantized_grads = cfg.zero.zero_quantized_gradients && s.stage >= 2 && s.world_size > 1;
  return Status::Ok();
}

}  // namespace

Result<EngineSetup> ResolveSetup(const Model& model, const EngineOptions& options,
                                 const comm::Collective& collective) {
  const Config& cfg = options.config;
  EngineSetup s;
  s.rank = collective.rank();
  s.file_rank = options.file_rank >= 0 ? options.file_rank : s.rank;
  s.world_size = collective.world_size();
  s.compute_dtype = ComputeDType(cfg);
  const Placement placement = PlacementOf(cfg);
  s.stage = placement.stage;
  s.compute_bytes = placement.compute_bytes;
  s.param_home = placement.param_home;
  s.optim_home = placement.optim_home;
  s.isa = optim::BestIsa();
  STRATA_RETURN_IF_ERROR(CheckOptions(options));
  STRATA_ASSIGN_OR_RETURN(s.layouts, LayoutModel(model.units(), s.world_size));
  STRATA_ASSIGN_OR_RETURN(s.frozen, FrozenUnitsOf(cfg, model.units()));
  ChooseOptimizers(cfg, options, s);
  STRATA_RETURN_IF_ERROR(CheckOffloadResources(cfg, options, s));
  for (const auto& l : s.layouts) s.max_shard = std::max(s.max_shard, l.shard_numel);
  STRATA_RETURN_IF_ERROR(ResolveSharing(model, s));
  STRATA_RETURN_IF_ERROR(ResolveZeroPlusPlus(cfg, options, s));
  if (options.tensor_parallel != nullptr && options.tensor_parallel->world_size() > 1) {
    s.tensor_parallel = options.tensor_parallel->world_size();
    s.tp_copied.resize(s.layouts.size());
    for (size_t u = 0; u < s.layouts.size(); ++u) {
      const auto& slots = s.layouts[u].slots;
      for (size_t i = 0; i < slots.size(); ++i) {
        int copies = model.TensorParallelCopies(static_cast<int>(u), i);
        if (copies == 0) copies = s.tensor_parallel;
        if (copies < 0 || copies > s.tensor_parallel || s.tensor_parallel % copies != 0) {
          return InvalidArgumentError(fmt::format(
              "the model says {} tensor-parallel ranks hold '{}'; expected a divisor of {}", copies,
              slots[i].name, s.tensor_parallel));
        }
        if (copies == 1) continue;
        auto at = std::find(s.tp_copies.begin(), s.tp_copies.end(), copies);
        if (at == s.tp_copies.end()) {
          if (static_cast<int>(s.tp_copies.size()) == EngineSetup::kMaxTensorParallelCopies) {
            return UnimplementedError(fmt::format(
                "the model's parameters are held by more than {} different numbers of "
                "tensor-parallel ranks",
                EngineSetup::kMaxTensorParallelCopies));
          }
          at = s.tp_copies.insert(s.tp_copies.end(), copies);
        }
        s.tp_copied[u].push_back({slots[i].offset, slots[i].offset + slots[i].numel,
                                  static_cast<int>(at - s.tp_copies.begin())});
      }
    }
  }
  return s;
}

}  // namespace strata::zero::engine_internal
