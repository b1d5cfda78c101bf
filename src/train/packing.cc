#include "train/packing.h"

#include <fmt/format.h>

#include <algorithm>

namespace strata::train {

Result<PackingPlan> PlanPacking(const PreparedTokens& data, const PackingOptions& options) {
  if (options.seq_len == 0) return InvalidArgumentError("packing: seq_len must be at least 1");
  if (options.seq_len >= (uint64_t{1} << 31)) {
    return InvalidArgumentError(fmt::format("packing: seq_len {} is too long", options.seq_len));
  }
  const uint64_t capacity = options.seq_len + 1;  // tokens per row
  PackingPlan plan;
  plan.pieces.reserve(data.documents());
  plan.row_begin.push_back(0);
  uint64_t used = 0;  // tokens in the row being filled
  const auto end_row = [&] {
    plan.pad_tokens += capacity - used;
    plan.row_begin.push_back(plan.pieces.size());
    used = 0;
  };
  const auto place = [&](uint64_t start, uint64_t length) {
    if (used > 0 && (!options.pack || used + length > capacity)) end_row();
    plan.pieces.push_back({start, static_cast<uint32_t>(length)});
    used += length;
    if (used == capacity) end_row();
  };
  for (uint64_t d = 0; d < data.documents(); ++d) {
    uint64_t start = data.doc_begin(d);
    const uint64_t end = data.doc_end(d);
    if (end - start > capacity) {
      if (options.long_documents == LongDocuments::kDrop) {
        ++plan.dropped_documents;
        plan.dropped_tokens += end - start;
        continue;
      }
      ++plan.split_documents;
      // Whole rows of it, each overlapping the next by one token (the next piece's first input
      // is this piece's last target), so every target of the document is trained once.
      while (end - start > capacity) {
        place(start, capacity);
        start += options.seq_len;
      }
      if (end - start < 2) continue;  // one token left: already trained as a target
    }
    place(start, end - start);
  }
  if (used > 0) end_row();
  if (plan.rows() == 0) {
    return InvalidArgumentError(fmt::format(
        "{}: no document is left to train on: all {} are longer than a row of {} tokens and "
        "--long-docs drop drops them",
        data.path(), data.documents(), capacity));
  }
  return plan;
}

namespace {

Status CheckRow(const PreparedTokens& data, const PackingPlan& plan, uint64_t row) {
  if (row >= plan.rows()) {
    return OutOfRangeError(
        fmt::format("{}: row {} is past its {} packed rows", data.path(), row, plan.rows()));
  }
  return Status::Ok();
}

}  // namespace

Result<uint64_t> ReadPackedRow(const PreparedTokens& data, const PackingPlan& plan,
                               const PackingOptions& options, uint64_t row, const PackedRow& out) {
  STRATA_RETURN_IF_ERROR(CheckRow(data, plan, row));
  const uint64_t seq = options.seq_len;
  if (out.tokens.size() != seq + 1 || out.targets.size() != seq || out.positions.size() != seq ||
      out.key_start.size() != seq) {
    return InvalidArgumentError(fmt::format(
        "ReadPackedRow: buffers of {}, {}, {}, {} entries; expected {} tokens and {} of the rest",
        out.tokens.size(), out.targets.size(), out.positions.size(), out.key_start.size(), seq + 1,
        seq));
  }
  std::vector<uint8_t> mask(seq + 1);
  uint64_t at = 0, trained = 0;
  for (uint64_t p = plan.row_begin[row]; p < plan.row_begin[row + 1]; ++p) {
    const PackingPlan::Piece& piece = plan.pieces[p];
    const uint64_t n = piece.length;
    STRATA_RETURN_IF_ERROR(data.Read(piece.start, out.tokens.subspan(at, n),
                                     std::span<uint8_t>(mask).subspan(at, n)));
    for (uint64_t j = 0; j < n; ++j) {
      const uint64_t i = at + j;  // slot in the row
      if (i >= seq) break;        // the row's last token is a target only
      out.positions[i] = static_cast<int32_t>(j);
      out.key_start[i] = static_cast<int32_t>(at);
      const bool trains = j + 1 < n && mask[i + 1] != 0;
      out.targets[i] = trains ? out.tokens[i + 1] : kTargetIgnored;
      trained += trains ? 1 : 0;
    }
    at += n;
  }
  for (uint64_t i = at; i <= seq; ++i) {
    out.tokens[i] = options.pad_token;
    if (i == seq) break;
    out.targets[i] = kTargetIgnored;
    out.positions[i] = 0;
    out.key_start[i] = static_cast<int32_t>(i);  // a pad sees itself only
  }
  return trained;
}

Result<uint64_t> TrainedTargets(const PreparedTokens& data, const PackingPlan& plan,
                                uint64_t row) {
  STRATA_RETURN_IF_ERROR(CheckRow(data, plan, row));
  uint64_t trained = 0;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  for (uint64_t p = plan.row_begin[row]; p < plan.row_begin[row + 1]; ++p) {
    const PackingPlan::Piece& piece = plan.pieces[p];
    if (piece.length < 2) continue;
    ids.resize(piece.length - 1);
    mask.resize(piece.length - 1);
    STRATA_RETURN_IF_ERROR(data.Read(piece.start + 1, ids, mask));
    trained += static_cast<uint64_t>(std::count(mask.begin(), mask.end(), uint8_t{1}));
  }
  return trained;
}

std::string DescribePacking(const PreparedTokens& data, const PackingPlan& plan,
                            const PackingOptions& options) {
  const uint64_t slots = plan.rows() * (options.seq_len + 1);
  std::string line = fmt::format(
      "{} document(s) {} {} row(s) of {} tokens ({:.2f} per row, {:.1f}% padding)",
      data.documents() - plan.dropped_documents, options.pack ? "packed into" : "one per row in",
      plan.rows(), options.seq_len + 1,
      static_cast<double>(data.documents() - plan.dropped_documents) /
          static_cast<double>(plan.rows()),
      100.0 * static_cast<double>(plan.pad_tokens) / static_cast<double>(slots));
  if (plan.split_documents > 0) {
    line += fmt::format("; {} longer than a row split into row-long pieces", plan.split_documents);
  }
  if (plan.dropped_documents > 0) {
    line += fmt::format("; {} longer than a row dropped ({} tokens)", plan.dropped_documents,
                        plan.dropped_tokens);
  }
  return line;
}

}  // namespace strata::train
