#include "zero/partition.h"

#include <fmt/format.h>
#include <fnmatch.h>

#include <algorithm>
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

std::vector<char> OffloadedUnits(const std::vector<UnitLayout>& layouts, double ratio,
                                 const std::vector<char>& frozen) {
  auto is_frozen = [&](size_t i) { return i < frozen.size() && frozen[i] != 0; };
  std::vector<char> out(layouts.size(), 0);
  if (ratio >= 1.0) {
    for (size_t i = 0; i < layouts.size(); ++i) out[i] = is_frozen(i) ? 0 : 1;
    return out;
  }
  int64_t total = 0;
  for (size_t i = 0; i < layouts.size(); ++i) {
    if (!is_frozen(i)) total += layouts[i].shard_numel;
  }
  const double target = ratio * static_cast<double>(total);
  double taken = 0.0;
  for (size_t i = layouts.size(); i-- > 0;) {
    if (is_frozen(i)) continue;
    const auto n = static_cast<double>(layouts[i].shard_numel);
    if (taken + 0.5 * n > target) break;
    out[i] = 1;
    taken += n;
  }
  return out;
}

Result<std::vector<char>> FrozenUnits(const std::vector<UnitSpec>& units,
                                      const std::vector<std::string>& freeze,
                                      const std::vector<std::string>& trainable) {
  std::vector<char> out(units.size(), 0);
  if (freeze.empty() && trainable.empty()) return out;
  const bool by_freeze = !freeze.empty();
  const std::vector<std::string>& patterns = by_freeze ? freeze : trainable;
  const char* key = by_freeze ? "strata.freeze" : "strata.trainable";
  std::vector<bool> used(patterns.size(), false);
  auto matches = [&](const std::string& name) {
    bool any = false;
    for (size_t k = 0; k < patterns.size(); ++k) {
      if (::fnmatch(patterns[k].c_str(), name.c_str(), 0) == 0) {
        used[k] = true;
        any = true;
      }
    }
    return any;
  };
  std::string example;
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitSpec& l = units[u];
    const ParamSpec* first_frozen = nullptr;
    const ParamSpec* first_trained = nullptr;
    for (const ParamSpec& s : l.params) {
      if (example.empty() || s.name.size() > example.size()) example = s.name;
      const bool frozen = matches(s.name) == by_freeze;
      const ParamSpec*& first = frozen ? first_frozen : first_trained;
      if (first == nullptr) first = &s;
    }
    if (first_frozen != nullptr && first_trained != nullptr) {
      return InvalidArgumentError(fmt::format(
          "{}: unit '{}' would be split: {} is frozen but {} is not; the engine freezes whole "
          "units (its parameters: {}), so the patterns must cover all of them or none",
          key, l.name, first_frozen->name, first_trained->name,
          [&] {
            std::string names;
            for (const ParamSpec& s : l.params) names += (names.empty() ? "" : ", ") + s.name;
            return names;
          }()));
    }
    out[u] = first_frozen != nullptr ? 1 : 0;
  }
  for (size_t k = 0; k < patterns.size(); ++k) {
    if (!used[k]) {
      return InvalidArgumentError(fmt::format(
          "{}: the pattern '{}' matches no parameter (parameter names look like '{}')", key,
          patterns[k], example));
    }
  }
  return out;
}

}  // namespace strata::zero
