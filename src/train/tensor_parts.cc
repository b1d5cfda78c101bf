#include "train/tensor_parts.h"

namespace strata::train {

TensorParts TensorParts::Of(const model::LlamaModel& model) {
  return For(model.config(), model.lora(), model.split_blocks(), model.tensor_parallel().rank,
             model.tensor_parallel().size);
}

TensorParts TensorParts::For(const model::LlamaConfig& whole, const model::LlamaLora& lora,
                             bool split_blocks, int rank, int size) {
  TensorParts parts;
  if (size <= 1) return parts;
  parts.rank_ = rank;
  parts.size_ = size;
  const int units = model::LlamaNumUnits(whole, lora, split_blocks);
  for (int u = 0; u < units; ++u) {
    for (const zero::ParamSpec& p : model::LlamaUnitParams(whole, u, lora, split_blocks)) {
      TensorPart part;
      part.whole_shape.assign(p.shape.begin(), p.shape.end());
      part.slice = model::LlamaTensorParallelSlice(whole, rank, size, p.name);
      // The first rank holding the same part writes it.
      for (int r = 0; r < rank && part.writes; ++r) {
        const model::TensorSlice other = model::LlamaTensorParallelSlice(whole, r, size, p.name);
        part.writes = other.dim != part.slice.dim || other.begin != part.slice.begin;
      }
      parts.parts_.emplace(p.name, std::move(part));
    }
  }
  return parts;
}

const TensorPart* TensorParts::Find(std::string_view name) const {
  const auto it = parts_.find(name);
  return it == parts_.end() ? nullptr : &it->second;
}

std::vector<uint64_t> TensorParts::FileShape(std::string_view name,
                                             const std::vector<int64_t>& shape) const {
  const TensorPart* part = Find(name);
  return part != nullptr ? part->whole_shape : std::vector<uint64_t>(shape.begin(), shape.end());
}

std::vector<PartRun> TensorParts::Runs(const TensorPart* part, uint64_t offset, uint64_t count) {
  if (count == 0) return {};
  if (part == nullptr || part->slice.dim < 0 || part->whole_shape.empty()) {
    return {{offset, count, 1, 0, 0}};
  }
  uint64_t row = 1;  // elements of one row (of dim 0) of the whole tensor
  for (size_t d = 1; d < part->whole_shape.size(); ++d)
    row *= part->whole_shape[d];
  const auto begin = static_cast<uint64_t>(part->slice.begin);
  if (part->slice.dim == 0) return {{begin * row + offset, count, 1, 0, 0}};
  // Columns [begin, begin + width) of every row.
  const auto width = static_cast<uint64_t>(part->slice.count);
  std::vector<PartRun> runs;
  uint64_t at = offset, done = 0;
  if (const uint64_t col = at % width; col != 0) {  // the tail of a row
    const uint64_t n = std::min(count, width - col);
    runs.push_back({at / width * row + begin + col, n, 1, 0, 0});
    at += n;
    done += n;
  }
  if (const uint64_t rows = (count - done) / width; rows > 0) {  // whole rows
    runs.push_back({at / width * row + begin, width, rows, row, done});
    at += rows * width;
    done += rows * width;
  }
  if (done < count) runs.push_back({at / width * row + begin, count - done, 1, 0, done});
  return runs;
}

}  // namespace strata::train
