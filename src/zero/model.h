// The model API the ZeRO engine trains: a model is a sequence of units, each a set of named
// parameters fetched together, with forward and backward functions over device buffers.
//
// The engine owns every parameter, gradient and optimizer state; the model owns its activations.
// For each micro-batch the engine calls
//   BeginMicroBatch(batch, loss_scale, stream)
//   Forward(0, p0, stream) ... Forward(U-1, pU-1, stream)
//   Backward(U-1, pU-1, gU-1, stream) ... Backward(0, p0, g0, stream)
//   EndMicroBatch(stream) -> the micro-batch's loss
// always on the same stream (the engine's compute stream), in that order. Each call only
// enqueues work on `stream` (Device::HostTask on the CPU device, kernels on CUDA); the buffers it
// is given stay valid until that work has run. A unit's `params` is the whole unit gathered, in
// the compute dtype; `grads` is fp32, zero-filled by the engine, and Backward writes d(loss *
// loss_scale)/d(param) of this micro-batch into it (only into its parameters' ranges), adding
// to what is there (see tied weights below). A frozen unit (strata.freeze / strata.trainable)
// has no gradient buffer: its `grads.data` is null, and Backward computes only what earlier
// units need (the input gradient), no weight gradient.
//
// Tied weights. A unit may also read the parameters of earlier units (SharedUnits: an LM head
// tied to the embedding matrix reads the embedding unit). For such a unit the engine calls
// ForwardShared / BackwardShared instead, with the unit's own view first and then the shared
// units' views, in SharedUnits order. The gradient views of the shared units are those units'
// gradient buffers of this micro-batch: the shared unit's own Backward runs later and gets the
// same buffer, already holding this unit's contribution. So every Backward must add into
// `grads` (they are zero-filled unless a tying unit already added to them), never overwrite.
//
// The loss a model reports is the mean over its micro-batch's samples; the engine averages over
// micro-batches and ranks, so every micro-batch must hold the same number of samples.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::zero {

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};

struct UnitSpec {
  std::string name;
  std::vector<ParamSpec> params;
};

// Where each parameter of a unit sits in the unit's flat buffer (element offsets).
struct ParamSlot {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel = 0;
};

// A unit's flat buffer as a model sees it.
struct UnitView {
  void* data = nullptr;  // device memory
  device::DType dtype = device::DType::kF32;
  const std::vector<ParamSlot>* slots = nullptr;

  // Pointer to parameter `i`'s first element.
  void* param(size_t i) const {
    return static_cast<char*>(data) + (*slots)[i].offset * static_cast<int64_t>(DTypeSize(dtype));
  }
};

// What a micro-batch is, is the model's business; the engine passes it through.
class Batch {
 public:
  virtual ~Batch() = default;
};

class Model {
 public:
  virtual ~Model() = default;

  virtual std::vector<UnitSpec> units() const = 0;
  // Initial values of unit `unit`'s parameters in fp32, `flat` laid out as `slots` (zeros
  // elsewhere). Must not depend on the rank: every rank computes the same values and keeps its
  // own shard.
  virtual Status InitUnit(int unit, const std::vector<ParamSlot>& slots,
                          std::span<float> flat) const = 0;
  // Elements [begin, begin + out.size()) of what InitUnit writes into a `used_numel`-element
  // `flat` (zeros past it: the unit's padding), bit for bit: for a rank that keeps only its
  // shard. The default initialises the whole unit and copies the range; a model whose
  // initialisation can start at any element overrides it, so that set-up holds a shard rather
  // than a unit (a 70B model's embedding is 1B parameters).
  virtual Status InitUnitRange(int unit, const std::vector<ParamSlot>& slots, int64_t used_numel,
                               int64_t begin, std::span<float> out) const {
    std::vector<float> full(static_cast<size_t>(used_numel), 0.0f);
    if (Status st = InitUnit(unit, slots, std::span<float>(full)); !st.ok()) return st;
    for (size_t i = 0; i < out.size(); ++i) {
      const int64_t at = begin + static_cast<int64_t>(i);
      out[i] = at >= 0 && at < used_numel ? full[static_cast<size_t>(at)] : 0.0f;
    }
    return Status::Ok();
  }

  virtual Status BeginMicroBatch(const Batch& batch, float loss_scale, device::Stream& stream) = 0;
  virtual Status Forward(int unit, const UnitView& params, device::Stream& stream) = 0;
  virtual Status Backward(int unit, const UnitView& params, const UnitView& grads,
                          device::Stream& stream) = 0;
  // Units whose parameters `unit` also reads; each must be < unit. Default: none.
  virtual std::vector<int> SharedUnits(int /*unit*/) const { return {}; }
  // For a unit with shared units: params[0] is the unit's, params[1..] the shared units'.
  virtual Status ForwardShared(int unit, std::span<const UnitView> params,
                               device::Stream& stream) {
    return Forward(unit, params[0], stream);
  }
  virtual Status BackwardShared(int unit, std::span<const UnitView> params,
                                std::span<const UnitView> grads, device::Stream& stream) {
    return Backward(unit, params[0], grads[0], stream);
  }

  // Activation checkpointing across units: the units whose forward runs again, in this order,
  // just before `unit`'s backward, because that backward reads their internals (a split decoder
  // block's MLP down projection reads what its attention, gate and up units computed). Each must
  // be < unit and share no units. The engine gathers each again for it. Default: none.
  virtual std::vector<int> RecomputeUnits(int /*unit*/) const { return {}; }
  // `unit`'s forward again, in backward (RecomputeUnits): it restores the internals later
  // backwards read and need not write what it passes on, which is kept. Default: Forward.
  virtual Status Recompute(int unit, const UnitView& params, device::Stream& stream) {
    return Forward(unit, params, stream);
  }

  // Returns the micro-batch's (unscaled) loss; may synchronize `stream`.
  virtual Result<double> EndMicroBatch(device::Stream& stream) = 0;

  // Tensor parallelism (EngineOptions::tensor_parallel): how many ranks of the tensor-parallel
  // group hold the same values as this rank's parameter `param` of `unit`: 1 for a part of a
  // split parameter that no other rank has, c for a part replicated on c ranks, 0 for a
  // parameter whole on every rank. The gradient norm counts each element once over the group
  // (each rank's squares weighted by 1 / copies). Default: 0.
  virtual int TensorParallelCopies(int /*unit*/, size_t /*param*/) const { return 0; }
};

}  // namespace strata::zero
