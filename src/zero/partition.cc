#include "zero/partition.h"

#include <fmt/format.h>

#include <set>

namespace strata::zero {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<UnitLayout> LayoutUnit(int index, const UnitSpec& spec, int world_size) {
  if (world_size < 1) {
    return InvalidArgumentError(fmt::format("unit '{}': world size {} < 1", spec.name, world_size));
  }
  if (spec.params.empty()) {
    return InvalidArgumentError(fmt::format("unit '{}' has no parameters", spec.name));
  }
  UnitLayout layout;
  layout.index = index;
  layout.name = spec.name;
  layout.world_size = world_size;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const ParamSpec& p : spec.params) {
    if (p.shape.empty()) {
      return InvalidArgumentError(
          fmt::format("unit '{}': parameter '{}' has an empty shape", spec.name, p.name));
    }
    for (int64_t d : p.shape) {
      if (d <= 0) {
        return InvalidArgumentError(fmt::format(
            "unit '{}': parameter '{}' has a dimension of {} (expected > 0)", spec.name, p.name, d));
      }
    }
    if (!names.insert(p.name).second) {
      return InvalidArgumentError(
          fmt::format("unit '{}': parameter name '{}' appears twice", spec.name, p.name));
    }
    offset = (offset + kParamAlignElems - 1) / kParamAlignElems * kParamAlignElems;
    ParamSlot slot{p.name, p.shape, offset, p.numel()};
    offset += slot.numel;
    layout.numel += slot.numel;
    layout.slots.push_back(std::move(slot));
  }
  layout.used_numel = offset;
  const int64_t per_rank = (offset + world_size - 1) / world_size;
  layout.shard_numel = (per_rank + kShardAlignElems - 1) / kShardAlignElems * kShardAlignElems;
  return layout;
}

Result<std::vector<UnitLayout>> LayoutModel(const std::vector<UnitSpec>& units, int world_size) {
  if (units.empty()) return InvalidArgumentError("the model has no units");
  std::vector<UnitLayout> out;
  out.reserve(units.size());
  for (size_t i = 0; i < units.size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(UnitLayout layout, LayoutUnit(static_cast<int>(i), units[i], world_size));
    out.push_back(std::move(layout));
  }
  return out;
}

std::vector<char> OffloadedUnits(const std::vector<UnitLayout>& layouts, double ratio) {
  std::vector<char> out(layouts.size(), 0);
  if (ratio >= 1.0) {
    out.assign(layouts.size(), 1);
    return out;
  }
  int64_t total = 0;
  for (const UnitLayout& l : layouts) total += l.shard_numel;
  const double target = ratio * static_cast<double>(total);
  double taken = 0.0;
  for (size_t i = layouts.size(); i-- > 0;) {
    const auto n = static_cast<double>(layouts[i].shard_numel);
    if (taken + 0.5 * n > target) break;
    out[i] = 1;
    taken += n;
  }
  return out;
}

}  // namespace strata::zero
