#include "train/training_data.h"

#include <fmt/format.h>

namespace strata::train {

std::string_view LongDocumentsName(LongDocuments mode) {
  return mode == LongDocuments::kDrop ? "drop" : "split";
}

Result<LongDocuments> ParseLongDocuments(std::string_view name) {
  if (name == "split") return LongDocuments::kSplit;
  if (name == "drop") return LongDocuments::kDrop;
  return InvalidArgumentError(
      fmt::format("--long-docs {}: expected \"split\" (a document longer than a row is cut into "
                  "row-long pieces) or \"drop\"",
                  name));
}

Result<std::unique_ptr<TrainingData>> TrainingData::Open(const std::string& path,
                                                         const DataOptions& options,
                                                         FileSystem& fs) {
  std::unique_ptr<TrainingData> d(new TrainingData());
  d->path_ = path;
  d->options_ = options;
  if (!IsPreparedData(path, fs)) {
    STRATA_ASSIGN_OR_RETURN(TokenDataset stream, TokenDataset::Open(path, options.vocab_size,
                                                                    options.stream_dtype, fs));
    d->stream_ = std::make_unique<TokenDataset>(std::move(stream));
    return d;
  }
  STRATA_ASSIGN_OR_RETURN(PreparedTokens prepared,
                          PreparedTokens::Open(path, options.vocab_size, fs));
  d->prepared_.emplace(std::move(prepared));
  DataOptions& o = d->options_;
  if (o.pad_token < 0) {
    const int64_t pad = d->prepared_->pad_token_id() >= 0 ? d->prepared_->pad_token_id()
                                                          : d->prepared_->eos_token_id();
    o.pad_token = pad >= 0 && static_cast<uint64_t>(pad) < o.vocab_size
                      ? static_cast<int32_t>(pad)
                      : 0;
  }
  PackingOptions packing;
  packing.seq_len = o.seq_len;
  packing.pack = o.pack;
  packing.long_documents = o.long_documents;
  packing.pad_token = o.pad_token;
  STRATA_ASSIGN_OR_RETURN(PackingPlan plan, PlanPacking(*d->prepared_, packing));
  d->plan_.emplace(std::move(plan));
  return d;
}

uint64_t TrainingData::tokens() const {
  return prepared_ ? prepared_->tokens() : stream_->size();
}

uint64_t TrainingData::rows() const {
  if (plan_) return plan_->rows();
  return stream_->size() > 0 ? (stream_->size() - 1) / options_.seq_len : 0;
}

std::string TrainingData::Describe() const {
  if (!prepared_) return fmt::format("{} tokens", stream_->size());
  PackingOptions packing;
  packing.seq_len = options_.seq_len;
  packing.pack = options_.pack;
  return fmt::format("prepared {} data, {} tokens ({} trained); {}", prepared_->shape(),
                     prepared_->tokens(), prepared_->trained_tokens(),
                     DescribePacking(*prepared_, *plan_, packing));
}

Result<uint64_t> TrainingData::Read(std::span<const uint64_t> rows, model::LlamaBatch* mb) const {
  const size_t seq = options_.seq_len, n = rows.size();
  mb->tokens.resize(n * (seq + 1));
  if (!prepared_) {
    mb->targets.clear();
    mb->positions.clear();
    mb->key_start.clear();
    for (size_t i = 0; i < n; ++i) {
      STRATA_RETURN_IF_ERROR(
          stream_->Read(rows[i] * seq, std::span<int32_t>(mb->tokens).subspan(i * (seq + 1), seq + 1)));
    }
    return static_cast<uint64_t>(n * seq);
  }
  mb->targets.resize(n * seq);
  mb->positions.resize(n * seq);
  mb->key_start.resize(n * seq);
  PackingOptions packing;
  packing.seq_len = options_.seq_len;
  packing.pack = options_.pack;
  packing.long_documents = options_.long_documents;
  packing.pad_token = options_.pad_token;
  uint64_t trained = 0;
  for (size_t i = 0; i < n; ++i) {
    PackedRow row;
    row.tokens = std::span<int32_t>(mb->tokens).subspan(i * (seq + 1), seq + 1);
    row.targets = std::span<int32_t>(mb->targets).subspan(i * seq, seq);
    row.positions = std::span<int32_t>(mb->positions).subspan(i * seq, seq);
    row.key_start = std::span<int32_t>(mb->key_start).subspan(i * seq, seq);
    STRATA_ASSIGN_OR_RETURN(const uint64_t t, ReadPackedRow(*prepared_, *plan_, packing, rows[i], row));
    trained += t;
  }
  return trained;
}

Result<uint64_t> TrainingData::TrainedTargets(std::span<const uint64_t> rows) const {
  if (!prepared_) return static_cast<uint64_t>(rows.size() * options_.seq_len);
  uint64_t trained = 0;
  for (uint64_t r : rows) {
    STRATA_ASSIGN_OR_RETURN(const uint64_t t, train::TrainedTargets(*prepared_, *plan_, r));
    trained += t;
  }
  return trained;
}

std::vector<double> LossWeights(std::span<const uint64_t> mine, uint64_t global, int world) {
  std::vector<double> w(mine.size(), 0.0);
  if (global == 0) return w;
  const double scale = static_cast<double>(world) * static_cast<double>(mine.size()) /
                       static_cast<double>(global);
  for (size_t a = 0; a < mine.size(); ++a) w[a] = scale * static_cast<double>(mine[a]);
  return w;
}

}  // namespace strata::train
