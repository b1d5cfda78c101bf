#include "train/prepared_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

#include "io/checksum_store.h"

namespace strata::train {

namespace {

constexpr uint64_t kMaxHeaderBytes = 16 << 20;

Status Bad(const std::string& path, std::string_view what) {
  return InvalidArgumentError(
      fmt::format("{}: not valid prepared token data (strata data prepare writes it): {}", path,
                  what));
}

}  // namespace

bool IsPreparedData(const std::string& path, FileSystem& fs) {
  Result<std::unique_ptr<File>> f = fs.Open(path, OpenMode::kRead);
  if (!f.ok()) return false;
  char magic[8];
  return (*f)->ReadAt(0, magic, 8).ok() && std::memcmp(magic, kPreparedMagic, 8) == 0;
}

Result<std::string> TokenizerHash(const std::string& model_dir, FileSystem& fs) {
  const std::filesystem::path dir(model_dir);
  if (!fs.Exists((dir / "tokenizer.json").string())) {
    return NotFoundError(fmt::format("{}: no tokenizer.json", model_dir));
  }
  std::string all;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}) {
    const std::string path = (dir / name).string();
    if (!fs.Exists(path)) continue;
    STRATA_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(fs, path));
    all += fmt::format("{}\n{}\n", name, text.size());
    all += text;
  }
  return io::ChecksumHex(io::Checksum64(std::as_bytes(std::span(all))));
}

Result<PreparedTokens> PreparedTokens::Open(const std::string& path, uint64_t vocab_size,
                                            FileSystem& fs) {
  PreparedTokens p;
  p.path_ = path;
  Result<std::unique_ptr<File>> opened = fs.Open(path, OpenMode::kRead);
  if (!opened.ok()) return opened.status().WithContext("prepared token data");
  p.file_ = std::move(opened).value();
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, p.file_->Size());
  if (size < 16) return Bad(path, fmt::format("{} bytes", size));
  char head[16];
  STRATA_RETURN_IF_ERROR(p.file_->ReadAt(0, head, 16));
  if (std::memcmp(head, kPreparedMagic, 8) != 0) return Bad(path, "no STRATATK magic");
  uint32_t version = 0, header_len = 0;
  std::memcpy(&version, head + 8, 4);
  std::memcpy(&header_len, head + 12, 4);
  if (version != kPreparedVersion) {
    return Bad(path, fmt::format("format version {}; this Strata reads version {}", version,
                                 kPreparedVersion));
  }
  if (header_len > kMaxHeaderBytes || 16 + header_len > size) {
    return Bad(path, fmt::format("a header of {} bytes in a {}-byte file", header_len, size));
  }
  std::string text(header_len, '\0');
  STRATA_RETURN_IF_ERROR(p.file_->ReadAt(16, text.data(), text.size()));
  const nlohmann::json h = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!h.is_object() || h.value("format", "") != "strata-tokens") {
    return Bad(path, "the header is not a strata-tokens JSON object");
  }
  uint64_t tokens = 0, documents = 0;
  try {
    tokens = h.at("tokens").get<uint64_t>();
    documents = h.at("documents").get<uint64_t>();
    p.trained_tokens_ = h.at("trained_tokens").get<uint64_t>();
    p.tokenizer_hash_ = h.at("tokenizer_hash").get<std::string>();
    p.eos_token_id_ = h.at("eos_token_id").is_null() ? -1 : h.at("eos_token_id").get<int64_t>();
    p.pad_token_id_ = h.value("pad_token_id", nlohmann::json()).is_null()
                          ? -1
                          : h.at("pad_token_id").get<int64_t>();
    p.shape_ = h.value("shape", "");
    const uint64_t max_id = h.at("max_token_id").get<uint64_t>();
    if (h.at("token_dtype").get<std::string>() != "uint32") {
      return Bad(path, "token_dtype is not uint32");
    }
    if (vocab_size > 0 && max_id >= vocab_size) {
      return InvalidArgumentError(fmt::format(
          "{}: holds token id {}, not below the model's vocab_size {} (prepared with another "
          "tokenizer?)",
          path, max_id, vocab_size));
    }
    const auto& s = h.at("sections");
    struct Section {
      const char* name;
      uint64_t bytes;
      uint64_t* offset;
    };
    uint64_t docs_offset = 0;
    const Section sections[] = {{"tokens", tokens * 4, &p.tokens_offset_},
                                {"loss_mask", tokens, &p.mask_offset_},
                                {"doc_offsets", (documents + 1) * 8, &docs_offset}};
    uint64_t end = 16 + header_len;
    for (const Section& sec : sections) {
      const uint64_t offset = s.at(sec.name).at("offset").get<uint64_t>();
      if (s.at(sec.name).at("bytes").get<uint64_t>() != sec.bytes || offset < end ||
          offset + sec.bytes > size) {
        return Bad(path, fmt::format("the {} section does not fit the file", sec.name));
      }
      *sec.offset = offset;
      end = offset + sec.bytes;
    }
    if (documents == 0) return Bad(path, "no documents");
    p.doc_offsets_.resize(documents + 1);
    STRATA_RETURN_IF_ERROR(
        p.file_->ReadAt(docs_offset, p.doc_offsets_.data(), p.doc_offsets_.size() * 8));
  } catch (const nlohmann::json::exception& e) {
    return Bad(path, e.what());
  }
  if (p.doc_offsets_.front() != 0 || p.doc_offsets_.back() != tokens) {
    return Bad(path, "the document offsets do not span the tokens");
  }
  for (size_t d = 1; d < p.doc_offsets_.size(); ++d) {
    if (p.doc_offsets_[d] <= p.doc_offsets_[d - 1]) {
      return Bad(path, fmt::format("document {} is empty or its offsets decrease", d - 1));
    }
  }
  return p;
}

Status PreparedTokens::Read(uint64_t start, std::span<int32_t> ids,
                            std::span<uint8_t> mask) const {
  const uint64_t n = ids.size();
  if (mask.size() != n || start > tokens() || n > tokens() - start) {
    return OutOfRangeError(fmt::format("{}: tokens [{}, {}) are past its {} tokens", path_, start,
                                       start + n, tokens()));
  }
  if (n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(file_->ReadAt(tokens_offset_ + start * 4, ids.data(), n * 4));
  return file_->ReadAt(mask_offset_ + start, mask.data(), n);
}

Status WritePreparedData(const std::string& path, const PreparedDocuments& in, FileSystem& fs) {
  if (in.documents.empty() || in.documents.size() != in.masks.size()) {
    return InvalidArgumentError(fmt::format("{}: {} documents and {} masks", path,
                                            in.documents.size(), in.masks.size()));
  }
  std::vector<uint64_t> offsets = {0};
  uint64_t trained = 0, max_id = 0;
  for (size_t d = 0; d < in.documents.size(); ++d) {
    if (in.documents[d].empty() || in.documents[d].size() != in.masks[d].size()) {
      return InvalidArgumentError(fmt::format("{}: document {} has {} tokens and {} mask bits",
                                              path, d, in.documents[d].size(),
                                              in.masks[d].size()));
    }
    offsets.push_back(offsets.back() + in.documents[d].size());
    for (size_t i = 0; i < in.masks[d].size(); ++i) {
      trained += in.masks[d][i] != 0 ? 1 : 0;
      max_id = std::max<uint64_t>(max_id, in.documents[d][i]);
    }
  }
  const uint64_t tokens = offsets.back();
  const auto align = [](uint64_t x) { return (x + 63) / 64 * 64; };
  nlohmann::json h = {{"format", "strata-tokens"},
                      {"version", kPreparedVersion},
                      {"token_dtype", "uint32"},
                      {"tokens", tokens},
                      {"documents", in.documents.size()},
                      {"trained_tokens", trained},
                      {"max_token_id", max_id},
                      {"eos_token_id", in.eos_token_id >= 0 ? nlohmann::json(in.eos_token_id)
                                                            : nlohmann::json()},
                      {"pad_token_id", in.pad_token_id >= 0 ? nlohmann::json(in.pad_token_id)
                                                            : nlohmann::json()},
                      {"tokenizer_hash", in.tokenizer_hash},
                      {"shape", in.shape}};
  // The sections' offsets depend on the header's length, which depends on them: settle it.
  uint64_t at[3] = {0, 0, 0};
  const uint64_t bytes[3] = {tokens * 4, tokens, offsets.size() * 8};
  const char* names[3] = {"tokens", "loss_mask", "doc_offsets"};
  std::string text;
  for (int round = 0; round < 4; ++round) {
    for (int k = 0; k < 3; ++k) h["sections"][names[k]] = {{"offset", at[k]}, {"bytes", bytes[k]}};
    text = h.dump();
    uint64_t next = 16 + text.size();
    bool same = true;
    for (int k = 0; k < 3; ++k) {
      next = align(next);
      same = same && at[k] == next;
      at[k] = next;
      next += bytes[k];
    }
    if (same) break;
  }
  std::string file(at[2] + bytes[2], '\0');
  std::memcpy(file.data(), kPreparedMagic, 8);
  const uint32_t version = kPreparedVersion, header_len = static_cast<uint32_t>(text.size());
  std::memcpy(file.data() + 8, &version, 4);
  std::memcpy(file.data() + 12, &header_len, 4);
  std::memcpy(file.data() + 16, text.data(), text.size());
  for (size_t d = 0; d < in.documents.size(); ++d) {
    std::memcpy(file.data() + at[0] + offsets[d] * 4, in.documents[d].data(),
                in.documents[d].size() * 4);
    for (size_t i = 0; i < in.masks[d].size(); ++i) {
      file[at[1] + offsets[d] + i] = in.masks[d][i] != 0 ? 1 : 0;
    }
  }
  std::memcpy(file.data() + at[2], offsets.data(), offsets.size() * 8);
  return WriteFileAtomic(fs, path, file);
}

}  // namespace strata::train
