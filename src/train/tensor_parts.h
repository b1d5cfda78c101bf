// Tensor parallelism in checkpoints and model directories. With tensor_parallel.autotp_size > 1
// each rank's model holds parts of the parameters (model::LlamaTensorParallelSlice: rows of
// q/k/v/gate/up and the vocabulary, columns of o/down), while files hold whole tensors in
// Hugging Face's layout, so that a checkpoint loads at any tensor- and data-parallel degree and
// in transformers. TensorParts says where each of a rank's parts lies in its whole tensor and
// maps a range of the part's elements (a ZeRO piece, zero::StatePiece) to the runs of the whole
// tensor they occupy: one run for rows, and for columns a row's tail, whole rows (one strided
// run) and a row's head.
//
// A part held by several ranks (a norm on every rank; a KV head replicated on size / kv ranks)
// is written by the first of them only (TensorPart::writes), so every byte of a checkpoint has
// one writer (checksum_manifest.h checks that).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "model/llama_model.h"

namespace strata::train {

struct TensorPart {
  std::vector<uint64_t> whole_shape;  // the tensor in the file
  model::TensorSlice slice;           // dim -1: the whole tensor
  bool writes = true;                 // false: a lower tensor-parallel rank writes the same part
};

// `chunks` runs of `chunk` elements, `stride` apart, from element `offset` of the whole tensor:
// the part's elements from `part_offset` on, in order.
struct PartRun {
  uint64_t offset = 0;
  uint64_t chunk = 0;
  uint64_t chunks = 1;
  uint64_t stride = 0;
  uint64_t part_offset = 0;
};

class TensorParts {
 public:
  // Whole tensors: no tensor parallelism.
  TensorParts() = default;
  // `model`'s parts (its tensor_parallel() rank of its size); whole tensors without TP.
  static TensorParts Of(const model::LlamaModel& model);
  // Rank `rank` of `size`'s parts of the model `whole` (with `lora`'s adapters, split blocks).
  static TensorParts For(const model::LlamaConfig& whole, const model::LlamaLora& lora,
                         bool split_blocks, int rank, int size);

  bool whole() const { return parts_.empty(); }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // The part of the tensor named `name` (the model's name for it); null: the whole tensor, which
  // this rank writes.
  const TensorPart* Find(std::string_view name) const;
  // The shape tensor `name` has in the files: its whole tensor's for a part, else `shape` (this
  // rank's, which is then the whole tensor).
  std::vector<uint64_t> FileShape(std::string_view name, const std::vector<int64_t>& shape) const;
  // The runs that elements [offset, offset + count) of `part` (null: a whole tensor) occupy in
  // the whole tensor: at most three.
  static std::vector<PartRun> Runs(const TensorPart* part, uint64_t offset, uint64_t count);

 private:
  int rank_ = 0;
  int size_ = 1;
  std::map<std::string, TensorPart, std::less<>> parts_;
};

}  // namespace strata::train
