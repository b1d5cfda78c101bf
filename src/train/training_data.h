// The data a run trains or evaluates on, whichever form it has, as numbered rows of seq_len + 1
// tokens that the sampler orders (data.h) and the trainer reads into micro-batches:
//
//   a token stream   (TokenDataset: .npy or raw tokens) cut into windows; every next token is a
//                    target, positions run 0..seq_len-1, attention is causal over the row.
//   prepared data    (PreparedTokens: what `strata data prepare` writes) packed into rows of
//                    whole documents (packing.h): targets only where the loss mask says,
//                    positions and attention restart at each document.
//
// With prepared data the micro-batches of a step hold different numbers of trained tokens, so
// LossWeights makes the step's loss the mean over every trained token of the global batch, not a
// mean of per-micro-batch means: what one big batch on one rank would give, whatever the world
// size, micro-batch and accumulation.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/llama_model.h"
#include "strata/file_system.h"
#include "strata/status.h"
#include "train/data.h"
#include "train/packing.h"
#include "train/prepared_data.h"

namespace strata::train {

struct DataOptions {
  uint64_t vocab_size = 0;                    // ids must be below it
  uint64_t seq_len = 0;                       // input tokens per row
  TokenDtype stream_dtype = TokenDtype::kUint16;  // a raw token stream's
  bool pack = true;                           // prepared data: several documents per row
  LongDocuments long_documents = LongDocuments::kSplit;
  int32_t pad_token = -1;  // prepared data: -1: the file's pad id, else its EOS, else 0
};

// "split", "drop".
std::string_view LongDocumentsName(LongDocuments mode);
Result<LongDocuments> ParseLongDocuments(std::string_view name);

class TrainingData {
 public:
  // Opens `path` as prepared data when it starts with the prepared magic, else as a token
  // stream. Errors name the file and what is wrong.
  static Result<std::unique_ptr<TrainingData>> Open(const std::string& path,
                                                    const DataOptions& options,
                                                    FileSystem& fs = LocalFileSystem());

  const std::string& path() const { return path_; }
  bool prepared() const { return prepared_.has_value(); }
  const PreparedTokens* prepared_tokens() const { return prepared_ ? &*prepared_ : nullptr; }
  const TokenDataset* stream() const { return stream_.get(); }  // null for prepared data
  const PackingPlan* packing() const { return plan_ ? &*plan_ : nullptr; }
  const DataOptions& options() const { return options_; }
  uint64_t tokens() const;
  uint64_t rows() const;
  // "12345 tokens" or the prepared data's documents and how they were packed.
  std::string Describe() const;

  // Rows `rows` into `mb`: tokens (rows.size() x (seq_len + 1)), and for prepared data the
  // targets, positions and key starts. Returns the number of trained targets.
  Result<uint64_t> Read(std::span<const uint64_t> rows, model::LlamaBatch* mb) const;
  // The trained targets of `rows` (seq_len each for a stream; the loss masks' for prepared data).
  Result<uint64_t> TrainedTargets(std::span<const uint64_t> rows) const;

 private:
  TrainingData() = default;
  std::string path_;
  DataOptions options_;
  std::unique_ptr<TokenDataset> stream_;
  std::optional<PreparedTokens> prepared_;
  std::optional<PackingPlan> plan_;
};

// The loss weight of each of this rank's micro-batches (LlamaBatch::loss_weight) when they hold
// `mine[a]` trained targets and the whole global batch `global` of them, over `world` ranks: the
// engine averages the micro-batches' (weighted) mean losses over world x mine.size(), so weight
// a = world x mine.size() x mine[a] / global makes that the mean over the global batch's tokens.
// All zero when the global batch trains no token.
std::vector<double> LossWeights(std::span<const uint64_t> mine, uint64_t global, int world);

}  // namespace strata::train
