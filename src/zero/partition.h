// The partitioner: units -> flat buffers -> equal per-rank shards.
//
// A unit's parameters are laid out one after another in a flat buffer, each starting at a
// multiple of kParamAlignElems elements (so every parameter is 128-byte aligned in any dtype).
// The buffer is padded to world_size * shard_numel elements, where shard_numel is a multiple of
// kShardAlignElems = 2048: a shard is then a 4 KiB multiple in 16-bit dtypes and an 8 KiB
// multiple in fp32, so every shard — parameters, fp32 gradients, master weights, moments — is one
// aligned O_DIRECT I/O and one collective. Rank r owns elements [r * shard_numel,
// (r + 1) * shard_numel) of every unit: its parameters, gradients, master weights and moments.
//
// Padding is zero in parameters and gradients, so it never changes a result: the optimizer keeps
// zero master weights at zero (zero gradient, zero moments), norms see zeros, and models only
// read their parameters' ranges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zero/model.h"
#include "strata/status.h"

namespace strata::zero {

inline constexpr int64_t kParamAlignElems = 64;
inline constexpr int64_t kShardAlignElems = 2048;
// ZeRO++'s quantized weight all-gather (zero_quantized_weights): one fp32 scale per block of
// this many elements. A divisor of kShardAlignElems, so that blocks never straddle shards.
inline constexpr int64_t kQuantBlockElems = 2048;
// What one rank's shard of `shard_numel` elements takes quantized: int8 values, then the scales.
inline constexpr uint64_t QuantizedShardBytes(int64_t shard_numel) {
  return static_cast<uint64_t>(shard_numel) +
         static_cast<uint64_t>(shard_numel / kQuantBlockElems) * 4;
}

struct UnitLayout {
  int index = 0;
  std::string name;
  std::vector<ParamSlot> slots;
  int64_t numel = 0;        // elements of real parameters (sum of slot sizes)
  int64_t used_numel = 0;   // end of the last slot (with alignment gaps)
  int64_t shard_numel = 0;  // per rank
  int world_size = 1;

  int64_t padded_numel() const { return shard_numel * world_size; }
  int64_t shard_offset(int rank) const { return shard_numel * rank; }
};

// InvalidArgument for a unit without parameters, a parameter with an empty or non-positive
// shape, or duplicate names within the unit.
Result<UnitLayout> LayoutUnit(int index, const UnitSpec& spec, int world_size);
Result<std::vector<UnitLayout>> LayoutModel(const std::vector<UnitSpec>& units, int world_size);

// Partial optimizer offload (offload_optimizer.ratio): which units' optimizer states are
// offloaded (1) and which stay on the device (0). Whole units, from the last towards the first
// (backward lands the last unit's gradients first, so its CPU update overlaps the most compute),
// taking each while at least half of it falls within `ratio` of the rank's shard elements.
// ratio >= 1 offloads every unit. Every rank computes the same split (shards are equal).
// Frozen units (`frozen`, when given) have no optimizer states: never offloaded, and not counted.
std::vector<char> OffloadedUnits(const std::vector<UnitLayout>& layouts, double ratio,
                                 const std::vector<char>& frozen = {});

// Frozen parameters (strata.freeze / strata.trainable, glob patterns on parameter names): per
// unit, 1 where every parameter is frozen. With `freeze` the parameters that match are frozen,
// with `trainable` those that do not (at most one of the two is non-empty). InvalidArgument for a
// unit whose parameters are partly frozen (the engine freezes whole units) and a pattern that
// matches no parameter. Everything frozen is valid here (evaluation: strata eval); `strata train`
// refuses it.
Result<std::vector<char>> FrozenUnits(const std::vector<UnitSpec>& units,
                                      const std::vector<std::string>& freeze,
                                      const std::vector<std::string>& trainable);

}  // namespace strata::zero
