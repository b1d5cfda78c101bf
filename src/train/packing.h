// Prepared documents (prepared_data.h) as training sequences: rows of seq_len + 1 tokens, each
// input token with its target, its position and the first key its attention may see.
//
// Packing (the default): documents go into rows in file order, as many as fit whole; a row ends
// where the next document would not fit, and pad tokens fill the rest. Without packing each row
// holds one document. A document longer than a row is split into pieces of a row each (the last
// piece packs like a document of its own) or dropped (LongDocuments). Every document and piece
// restarts its positions at 0, and its tokens attend only to its own earlier tokens: rows are
// trained as if each document were alone (LlamaBatch::positions, key_start).
//
// Input token j of a row (j < seq_len) is trained to predict token j + 1 when both belong to the
// same document piece and token j + 1's loss-mask bit is set (assistant turns, completions);
// every other target is kIgnoreIndex: across documents, into pads, prompts.
//
// The plan (PlanPacking) lists each row's pieces: a few bytes per document, made once at open;
// rows are read on demand (ReadPackedRow). Deterministic: the same file, seq_len and options give
// the same rows, so a resumed run finds its place.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "strata/status.h"
#include "train/prepared_data.h"

namespace strata::train {

inline constexpr int32_t kTargetIgnored = -100;  // as model::cpu::kIgnoreIndex

enum class LongDocuments { kSplit, kDrop };

struct PackingOptions {
  uint64_t seq_len = 0;  // input tokens per row (a row holds seq_len + 1)
  bool pack = true;      // several documents per row; false: one per row, padded
  LongDocuments long_documents = LongDocuments::kSplit;
  int32_t pad_token = 0;  // the id pads carry (never a target)
};

struct PackingPlan {
  struct Piece {
    uint64_t start = 0;   // first token in the file
    uint32_t length = 0;  // tokens
  };
  std::vector<Piece> pieces;
  std::vector<uint64_t> row_begin;  // row r holds pieces [row_begin[r], row_begin[r + 1])
  uint64_t split_documents = 0;     // documents longer than a row, split
  uint64_t dropped_documents = 0;   // ... or dropped
  uint64_t dropped_tokens = 0;
  uint64_t pad_tokens = 0;          // over all rows
  uint64_t rows() const { return row_begin.empty() ? 0 : row_begin.size() - 1; }
};

// The rows of `data` (InvalidArgument when seq_len is 0 or no document is left).
Result<PackingPlan> PlanPacking(const PreparedTokens& data, const PackingOptions& options);

// Row `row`: tokens [seq_len + 1] (pads after the last piece), and per input token its target,
// position and key start [seq_len] each. Returns the number of trained targets.
struct PackedRow {
  std::span<int32_t> tokens, targets, positions, key_start;
};
Result<uint64_t> ReadPackedRow(const PreparedTokens& data, const PackingPlan& plan,
                               const PackingOptions& options, uint64_t row, const PackedRow& out);
// The number of trained targets of row `row` (its loss mask only: cheaper than ReadPackedRow).
Result<uint64_t> TrainedTargets(const PreparedTokens& data, const PackingPlan& plan, uint64_t row);

// One line for the run's banner: rows, documents per row, pads, split and dropped documents.
std::string DescribePacking(const PreparedTokens& data, const PackingPlan& plan,
                            const PackingOptions& options);

}  // namespace strata::train
