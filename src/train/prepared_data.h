// Prepared token data: what `strata data prepare` writes (tools/prepare_data.py) and `strata
// train` / `strata eval` read. One file (docs/formats.md, "Prepared token data"):
//
//   "STRATATK"  u32 version (1)  u32 header length  header JSON (utf-8)
//   tokens       u32 little-endian, every document's ids one after the other
//   loss_mask    u8 per token: 1 when the token is trained as a target (assistant turns,
//                completions, or everything with --train-on-prompt)
//   doc_offsets  u64 x (documents + 1): document d is tokens [doc_offsets[d], doc_offsets[d + 1])
// each section at the 64-byte-aligned offset the header's "sections" gives. The header also
// holds the tokenizer's hash (TokenizerHash of the model directory it was prepared with), the
// EOS and pad ids, and the counts.
//
// PreparedTokens reads it through the file seam, never whole: the document offsets are read at
// Open (8 bytes per document), tokens and masks as ranges. Open validates everything a reader
// relies on (magic, version, sections inside the file and not overlapping, offsets increasing
// and ending at the token count, ids below the vocabulary when it is given): a damaged or
// foreign file is an error naming it and what is wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::train {

inline constexpr char kPreparedMagic[] = "STRATATK";
inline constexpr uint32_t kPreparedVersion = 1;

// True when `path` starts with the prepared-data magic (a token stream otherwise).
bool IsPreparedData(const std::string& path, FileSystem& fs = LocalFileSystem());

// The hash of a model directory's tokenizer: XXH3-64 over the bytes of tokenizer.json,
// tokenizer_config.json and chat_template.jinja (each present one, in that order, each prefixed
// by its name and size), as 16 hex digits. NotFound when the directory holds no tokenizer.json.
Result<std::string> TokenizerHash(const std::string& model_dir, FileSystem& fs = LocalFileSystem());

class PreparedTokens {
 public:
  // `vocab_size` > 0: every id must be below it (the header's max_token_id is checked).
  static Result<PreparedTokens> Open(const std::string& path, uint64_t vocab_size = 0,
                                     FileSystem& fs = LocalFileSystem());

  const std::string& path() const { return path_; }
  uint64_t tokens() const { return doc_offsets_.empty() ? 0 : doc_offsets_.back(); }
  uint64_t documents() const { return doc_offsets_.size() - 1; }
  uint64_t trained_tokens() const { return trained_tokens_; }
  // Document d: tokens [doc_begin(d), doc_end(d)).
  uint64_t doc_begin(uint64_t d) const { return doc_offsets_[d]; }
  uint64_t doc_end(uint64_t d) const { return doc_offsets_[d + 1]; }
  const std::string& tokenizer_hash() const { return tokenizer_hash_; }
  int64_t eos_token_id() const { return eos_token_id_; }
  int64_t pad_token_id() const { return pad_token_id_; }  // -1: none
  const std::string& shape() const { return shape_; }   // "text", "messages", ...

  // Tokens [start, start + ids.size()) and their loss mask.
  Status Read(uint64_t start, std::span<int32_t> ids, std::span<uint8_t> mask) const;

 private:
  std::string path_;
  std::shared_ptr<File> file_;
  std::vector<uint64_t> doc_offsets_;
  uint64_t tokens_offset_ = 0, mask_offset_ = 0;
  uint64_t trained_tokens_ = 0;
  std::string tokenizer_hash_;
  int64_t eos_token_id_ = -1, pad_token_id_ = -1;
  std::string shape_;
};

// Writes prepared data in memory to `path` (atomically: WriteFileAtomic), as tools/
// prepare_data.py does for datasets: for tests, and for programs that make documents themselves.
// `documents[d]` are document d's ids and `masks[d]` its loss mask (the same length, 0 or 1).
struct PreparedDocuments {
  std::vector<std::vector<uint32_t>> documents;
  std::vector<std::vector<uint8_t>> masks;
  std::string tokenizer_hash = "0000000000000000";
  int64_t eos_token_id = -1, pad_token_id = -1;
  std::string shape = "messages";
};
Status WritePreparedData(const std::string& path, const PreparedDocuments& in,
                         FileSystem& fs = LocalFileSystem());

}  // namespace strata::train
