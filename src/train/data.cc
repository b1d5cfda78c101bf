#include "train/data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include "common/errno.h"
#include "train/safetensors.h"

namespace strata::train {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicLen = 6;
// A real header is ~128 bytes; the bound keeps a corrupt length from allocating gigabytes.
constexpr uint64_t kMaxNpyHeaderLen = 1 << 20;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t Mix(uint64_t a, uint64_t b) {
  return SplitMix64(a ^ SplitMix64(b + 0x632be59bd9b4e019ull));
}

std::string_view NpyDescr(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint16:
      return "<u2";
    case TokenDtype::kUint32:
      return "<u4";
    case TokenDtype::kInt32:
      return "<i4";
  }
  return "?";
}

bool HasNpyExtension(const std::string& path) {
  return std::filesystem::path(path).extension() == ".npy";
}

// ---- .npy header dictionary: a tiny parser for the Python literal numpy writes ----------------

struct NpyValue {
  enum Kind { kString, kBool, kTuple } kind = kString;
  std::string text;
  bool flag = false;
  std::vector<uint64_t> dims;
};

class NpyDictParser {
 public:
  explicit NpyDictParser(std::string_view text) : s_(text) {}

  // Fills `out` with key -> value; returns an error text on malformed input.
  std::optional<std::string> Parse(std::vector<std::pair<std::string, NpyValue>>* out) {
    SkipSpace();
    if (!Eat('{')) return "expected '{' at the start of the header dictionary";
    while (true) {
      SkipSpace();
      if (Eat('}')) break;
      std::string key;
      if (!String(&key)) return fmt::format("expected a quoted key at header offset {}", i_);
      SkipSpace();
      if (!Eat(':')) return fmt::format("expected ':' after key '{}'", key);
      SkipSpace();
      NpyValue value;
      if (auto err = Value(&value)) return fmt::format("value of '{}': {}", key, *err);
      out->emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (Eat(',')) continue;
      SkipSpace();
      if (Eat('}')) break;
      return fmt::format("expected ',' or '}}' at header offset {}", i_);
    }
    return std::nullopt;
  }

 private:
  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  bool Eat(char c) {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool String(std::string* out) {
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) return false;
    const char quote = s_[i_++];
    size_t end = s_.find(quote, i_);
    if (end == std::string_view::npos) return false;
    *out = std::string(s_.substr(i_, end - i_));
    i_ = end + 1;
    return true;
  }
  bool Word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  std::optional<std::string> Value(NpyValue* v) {
    if (i_ < s_.size() && (s_[i_] == '\'' || s_[i_] == '"')) {
      v->kind = NpyValue::kString;
      if (!String(&v->text)) return "unterminated string";
      return std::nullopt;
    }
    if (Word("True")) {
      v->kind = NpyValue::kBool;
      v->flag = true;
      return std::nullopt;
    }
    if (Word("False")) {
      v->kind = NpyValue::kBool;
      v->flag = false;
      return std::nullopt;
    }
    if (Eat('(')) {
      v->kind = NpyValue::kTuple;
      while (true) {
        SkipSpace();
        if (Eat(')')) return std::nullopt;
        uint64_t dim = 0;
        const char* first = s_.data() + i_;
        auto [ptr, ec] = std::from_chars(first, s_.data() + s_.size(), dim);
        if (ec != std::errc() || ptr == first)
          return "expected a non-negative integer in the tuple";
        i_ += static_cast<size_t>(ptr - first);
        Eat('L');  // Python 2 long literals, e.g. (10L,)
        v->dims.push_back(dim);
        SkipSpace();
        if (Eat(',')) continue;
        SkipSpace();
        if (Eat(')')) return std::nullopt;
        return "expected ',' or ')' in the tuple";
      }
    }
    return "expected a string, True, False or a tuple";
  }

  std::string_view s_;
  size_t i_ = 0;
};

std::string ShapeText(const std::vector<uint64_t>& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i)
    s += fmt::format("{}{}", i ? ", " : "", dims[i]);
  if (dims.size() == 1) s += ",";
  return s + ")";
}

struct NpyLayout {
  TokenDtype dtype;
  uint64_t num_tokens;
  uint64_t data_offset;
};

Result<NpyLayout> ParseNpyHeader(const File& file, const std::string& path, uint64_t file_size) {
  auto bad = [&](std::string_view what) {
    return InvalidArgumentError(fmt::format("{}: not a valid .npy file: {}", path, what));
  };
  if (file_size < 10) return bad(fmt::format("the file is only {} bytes", file_size));
  unsigned char pre[12] = {};
  const size_t pre_len = std::min<uint64_t>(sizeof(pre), file_size);
  STRATA_RETURN_IF_ERROR(file.ReadAt(0, pre, pre_len));
  if (std::memcmp(pre, kNpyMagic, kNpyMagicLen) != 0) {
    return bad("it does not start with the magic \"\\x93NUMPY\"");
  }
  const int major = pre[6];
  const int minor = pre[7];
  uint64_t header_len = 0;
  uint64_t header_start = 0;
  if (major == 1) {
    header_len = pre[8] | (uint64_t{pre[9]} << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (pre_len < 12) return bad("the file ends inside the header length");
    header_len =
        pre[8] | (uint64_t{pre[9]} << 8) | (uint64_t{pre[10]} << 16) | (uint64_t{pre[11]} << 24);
    header_start = 12;
  } else {
    return bad(
        fmt::format("format version {}.{} is not supported (1.0, 2.0 or 3.0)", major, minor));
  }
  if (header_len > kMaxNpyHeaderLen) {
    return bad(fmt::format("the header length {} is implausibly large", header_len));
  }
  if (header_start + header_len > file_size) {
    return bad(fmt::format("the header length {} runs past the end of the {}-byte file", header_len,
                           file_size));
  }
  std::string header(header_len, '\0');
  STRATA_RETURN_IF_ERROR(file.ReadAt(header_start, header.data(), header_len));

  std::vector<std::pair<std::string, NpyValue>> dict;
  NpyDictParser parser(header);
  if (auto err = parser.Parse(&dict)) return bad(fmt::format("header dictionary: {}", *err));
  const NpyValue* descr = nullptr;
  const NpyValue* fortran = nullptr;
  const NpyValue* shape = nullptr;
  for (const auto& [key, value] : dict) {
    if (key == "descr") descr = &value;
    if (key == "fortran_order") fortran = &value;
    if (key == "shape") shape = &value;
  }
  if (descr == nullptr || descr->kind != NpyValue::kString) {
    return bad("the header has no 'descr' string");
  }
  if (fortran == nullptr || fortran->kind != NpyValue::kBool) {
    return bad("the header has no 'fortran_order' True/False");
  }
  if (shape == nullptr || shape->kind != NpyValue::kTuple) {
    return bad("the header has no 'shape' tuple");
  }
  NpyLayout layout{};
  if (descr->text == "<u2") {
    layout.dtype = TokenDtype::kUint16;
  } else if (descr->text == "<u4") {
    layout.dtype = TokenDtype::kUint32;
  } else if (descr->text == "<i4") {
    layout.dtype = TokenDtype::kInt32;
  } else {
    return InvalidArgumentError(fmt::format(
        "{}: dtype '{}' is not supported for tokens; expected '<u2' (uint16), '<u4' (uint32) or "
        "'<i4' (int32)",
        path, descr->text));
  }
  if (shape->dims.size() != 1) {
    return InvalidArgumentError(
        fmt::format("{}: the array is {}-D (shape {}); expected a 1-D token array", path,
                    shape->dims.size(), ShapeText(shape->dims)));
  }
  // fortran_order is irrelevant for a 1-D array: both orders store it the same way.
  layout.num_tokens = shape->dims[0];
  layout.data_offset = header_start + header_len;
  const uint64_t item = TokenDtypeSize(layout.dtype);
  if (layout.num_tokens > (file_size / item) + 1) {
    // Guards the multiplication below against overflow; reported as the short file it is.
    return DataLossError(fmt::format("{}: the header says {} tokens but the file is only {} bytes",
                                     path, layout.num_tokens, file_size));
  }
  const uint64_t need = layout.data_offset + layout.num_tokens * item;
  if (file_size < need) {
    return DataLossError(fmt::format(
        "{}: the file is {} bytes but its header says {} tokens of {} bytes after a {}-byte "
        "header ({} bytes); it is truncated",
        path, file_size, layout.num_tokens, item, layout.data_offset, need));
  }
  if (file_size > need) {
    return InvalidArgumentError(
        fmt::format("{}: {} unexpected bytes after the {} tokens its header describes", path,
                    file_size - need, layout.num_tokens));
  }
  return layout;
}

// Where a step starts, counting `steps` steps from `from` with `per_step` positions each, in
// epochs of `num_windows` positions whose tail (< per_step) is skipped.
StepStart Walk(StepStart from, uint64_t steps, uint64_t per_step, uint64_t num_windows) {
  const uint64_t left_in_epoch = (num_windows - from.position) / per_step;
  if (steps < left_in_epoch) return {from.epoch, from.position + steps * per_step};
  const uint64_t after = steps - left_in_epoch;
  const uint64_t per_epoch = num_windows / per_step;
  return {from.epoch + 1 + after / per_epoch, (after % per_epoch) * per_step};
}

}  // namespace

// ---- dtypes ------------------------------------------------------------------------------------

std::string_view TokenDtypeName(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint16:
      return "uint16";
    case TokenDtype::kUint32:
      return "uint32";
    case TokenDtype::kInt32:
      return "int32";
  }
  return "?";
}

Result<TokenDtype> ParseTokenDtype(std::string_view name) {
  for (TokenDtype d : {TokenDtype::kUint16, TokenDtype::kUint32, TokenDtype::kInt32}) {
    if (name == TokenDtypeName(d)) return d;
  }
  return InvalidArgumentError(
      fmt::format("token dtype '{}' is not one of uint16, uint32, int32", name));
}

size_t TokenDtypeSize(TokenDtype dtype) {
  return dtype == TokenDtype::kUint16 ? 2 : 4;
}

// ---- TokenDataset ------------------------------------------------------------------------------

Result<TokenDataset> TokenDataset::Open(const std::string& path, uint64_t vocab_size,
                                        TokenDtype bin_dtype, FileSystem& fs) {
  if (vocab_size == 0 || vocab_size > kMaxVocabSize) {
    return InvalidArgumentError(
        fmt::format("{}: vocab size {} is not in [1, {}]", path, vocab_size, kMaxVocabSize));
  }
  TokenDataset d;
  d.path_ = path;
  d.vocab_size_ = vocab_size;
  if (fs.IsDirectory(path)) return InvalidArgumentError(fmt::format("{}: not a regular file", path));
  Result<std::unique_ptr<File>> opened = fs.Open(path, OpenMode::kRead);
  if (!opened.ok()) return opened.status().WithContext("token file");
  d.file_ = std::move(opened).value();
  STRATA_ASSIGN_OR_RETURN(const uint64_t file_size, d.file_->Size());
  d.is_npy_ = HasNpyExtension(path);
  if (d.is_npy_) {
    STRATA_ASSIGN_OR_RETURN(NpyLayout layout, ParseNpyHeader(*d.file_, path, file_size));
    d.dtype_ = layout.dtype;
    d.num_tokens_ = layout.num_tokens;
    d.data_offset_ = layout.data_offset;
  } else {
    d.dtype_ = bin_dtype;
    const uint64_t item = TokenDtypeSize(bin_dtype);
    if (file_size % item != 0) {
      return InvalidArgumentError(fmt::format(
          "{}: {} bytes is not a whole number of {} tokens ({} bytes each); wrong --data-dtype?", path,
          file_size, TokenDtypeName(bin_dtype), item));
    }
    d.num_tokens_ = file_size / item;
    d.data_offset_ = 0;
  }
  if (d.num_tokens_ == 0) return InvalidArgumentError(fmt::format("{}: holds no tokens", path));
  return d;
}

TokenDataset::TokenDataset(TokenDataset&& other) noexcept = default;
TokenDataset& TokenDataset::operator=(TokenDataset&& other) noexcept = default;
TokenDataset::~TokenDataset() = default;

Status TokenDataset::Read(uint64_t start, std::span<int32_t> out) const {
  const uint64_t count = out.size();
  if (start > num_tokens_ || count > num_tokens_ - start) {
    return OutOfRangeError(fmt::format("{}: tokens [{}, {}) are past the end of its {} tokens",
                                       path_, start, start + count, num_tokens_));
  }
  if (count == 0) return Status::Ok();
  const uint64_t offset = data_offset_ + start * TokenDtypeSize(dtype_);
  auto check = [&](uint64_t i, int64_t value) -> Status {
    if (value < 0) {
      return InvalidArgumentError(
          fmt::format("{}: token at position {} is negative ({})", path_, start + i, value));
    }
    if (static_cast<uint64_t>(value) >= vocab_size_) {
      return InvalidArgumentError(
          fmt::format("{}: token at position {} is {}, not below the vocab "
                      "size {}",
                      path_, start + i, value, vocab_size_));
    }
    return Status::Ok();
  };
  // Host byte order is little-endian on every platform Strata runs on (x86-64, aarch64).
  static_assert(std::endian::native == std::endian::little);
  if (dtype_ == TokenDtype::kUint16) {
    std::vector<uint16_t> raw(count);
    STRATA_RETURN_IF_ERROR(file_->ReadAt(offset, raw.data(), count * 2));
    for (uint64_t i = 0; i < count; ++i) {
      STRATA_RETURN_IF_ERROR(check(i, raw[i]));
      out[i] = static_cast<int32_t>(raw[i]);
    }
    return Status::Ok();
  }
  // 4-byte tokens are read in place and checked as their own type.
  STRATA_RETURN_IF_ERROR(file_->ReadAt(offset, out.data(), count * 4));
  for (uint64_t i = 0; i < count; ++i) {
    int64_t value = 0;
    if (dtype_ == TokenDtype::kUint32) {
      uint32_t u = 0;
      std::memcpy(&u, &out[i], 4);
      value = u;
    } else {
      value = out[i];
    }
    STRATA_RETURN_IF_ERROR(check(i, value));
  }
  return Status::Ok();
}

// ---- TokenFileWriter ---------------------------------------------------------------------------

std::string NpyHeader(TokenDtype dtype, uint64_t num_tokens) {
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({},), }}",
                                 NpyDescr(dtype), num_tokens);
  // magic (6) + version (2) + length (2) + dict + padding + '\n' is a multiple of 64.
  const size_t unpadded = kNpyMagicLen + 2 + 2 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  std::string header(kNpyMagic, kNpyMagicLen);
  header.push_back('\x01');
  header.push_back('\x00');
  header.push_back(static_cast<char>(dict.size() & 0xff));
  header.push_back(static_cast<char>((dict.size() >> 8) & 0xff));
  return header + dict;
}

Result<TokenFileWriter> TokenFileWriter::Create(const std::string& path, TokenDtype dtype,
                                                uint64_t num_tokens, FileSystem& fs) {
  TokenFileWriter w;
  w.fs_ = &fs;
  w.path_ = path;
  w.temp_path_ = fmt::format("{}.tmp.{}", path, ::getpid());
  w.dtype_ = dtype;
  w.num_tokens_ = num_tokens;
  Result<std::unique_ptr<File>> opened = fs.Open(w.temp_path_, OpenMode::kCreate);
  if (!opened.ok()) {
    return opened.status().WithContext(fmt::format("the temporary file for {}", path));
  }
  w.file_ = std::move(opened).value();
  if (HasNpyExtension(path)) {
    const std::string header = NpyHeader(dtype, num_tokens);
    w.header_bytes_ = header.size();
    STRATA_RETURN_IF_ERROR(w.file_->WriteAt(0, header.data(), header.size()));
  }
  return w;
}

TokenFileWriter::TokenFileWriter(TokenFileWriter&& other) noexcept
    : fs_(other.fs_),
      path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      file_(std::move(other.file_)),
      dtype_(other.dtype_),
      header_bytes_(other.header_bytes_),
      num_tokens_(other.num_tokens_),
      written_(other.written_),
      buffer_(std::move(other.buffer_)) {}

TokenFileWriter& TokenFileWriter::operator=(TokenFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    fs_ = other.fs_;
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    file_ = std::move(other.file_);
    dtype_ = other.dtype_;
    header_bytes_ = other.header_bytes_;
    num_tokens_ = other.num_tokens_;
    written_ = other.written_;
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

TokenFileWriter::~TokenFileWriter() {
  Abandon();
}

void TokenFileWriter::Abandon() {
  if (file_) {
    file_.reset();
    (void)fs_->RemoveAll(temp_path_);
  }
}

uint64_t TokenFileWriter::file_bytes() const {
  return header_bytes_ + num_tokens_ * TokenDtypeSize(dtype_);
}

Status TokenFileWriter::Append(std::span<const uint32_t> tokens) {
  if (!file_) return FailedPreconditionError(fmt::format("{}: writer is closed", path_));
  if (tokens.size() > num_tokens_ - written_) {
    return InvalidArgumentError(fmt::format("{}: appending {} tokens to {} of {} would overflow",
                                            path_, tokens.size(), written_, num_tokens_));
  }
  const uint64_t max = dtype_ == TokenDtype::kUint16  ? 0xffff
                       : dtype_ == TokenDtype::kInt32 ? 0x7fffffff
                                                      : 0xffffffff;
  const size_t item = TokenDtypeSize(dtype_);
  buffer_.resize(tokens.size() * item);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] > max) {
      return InvalidArgumentError(
          fmt::format("{}: token {} does not fit {}", path_, tokens[i], TokenDtypeName(dtype_)));
    }
    if (item == 2) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      std::memcpy(buffer_.data() + 4 * i, &tokens[i], 4);
    }
  }
  STRATA_RETURN_IF_ERROR(file_->WriteAt(header_bytes_ + written_ * item, buffer_.data(),
                                        buffer_.size()));
  written_ += tokens.size();
  return Status::Ok();
}

Status TokenFileWriter::Commit() {
  if (!file_) return FailedPreconditionError(fmt::format("{}: writer is closed", path_));
  if (written_ != num_tokens_) {
    return FailedPreconditionError(fmt::format("{}: {} of the {} announced tokens were written",
                                               path_, written_, num_tokens_));
  }
  Status st = file_->Sync();
  file_.reset();
  if (st.ok()) st = fs_->Rename(temp_path_, path_);
  if (!st.ok()) {
    (void)fs_->RemoveAll(temp_path_);
    return st;
  }
  // The rename is durable only once the directory is synced.
  return fs_->SyncDir(ParentDir(path_));
}

// ---- Sampling ----------------------------------------------------------------------------------

std::string_view SamplingModeName(SamplingMode mode) {
  return mode == SamplingMode::kSequential ? "sequential" : "random";
}

Result<SamplingMode> ParseSamplingMode(std::string_view name) {
  if (name == "sequential") return SamplingMode::kSequential;
  if (name == "random") return SamplingMode::kRandom;
  return InvalidArgumentError(
      fmt::format("sampling mode '{}' is not one of sequential, random", name));
}

uint64_t PermuteWindow(uint64_t seed, uint64_t epoch, uint64_t num_windows, uint64_t position) {
  if (num_windows <= 1) return 0;
  // A balanced Feistel network on 2*half bits, the smallest even width that covers num_windows;
  // values that land outside [0, num_windows) are walked again (at most ~4 times on average,
  // since the domain is < 4 * num_windows). Walking a bijection's cycles restricted to a subset
  // is a bijection of that subset.
  const int bits = std::bit_width(num_windows - 1);
  const int half = std::max(1, (bits + 1) / 2);
  const uint64_t mask = (uint64_t{1} << half) - 1;
  const uint64_t key = Mix(seed, epoch);
  uint64_t x = position;
  do {
    uint64_t left = x >> half;
    uint64_t right = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = Mix(key + round, right) & mask;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= num_windows);
  return x;
}

Status ValidateBatchLayout(const BatchLayout& layout) {
  if (layout.world_size < 1 || layout.micro_batch < 1 || layout.grad_accum < 1) {
    return InvalidArgumentError(fmt::format(
        "batch layout world_size {} micro_batch {} grad_accum {}: each must be at least 1",
        layout.world_size, layout.micro_batch, layout.grad_accum));
  }
  return Status::Ok();
}

Result<SequenceSampler> SequenceSampler::Create(const TokenDataset* data,
                                                const SamplerOptions& options) {
  if (data == nullptr) return InvalidArgumentError("sequence sampler: no dataset");
  if (options.seq_len == 0) return InvalidArgumentError("sequence sampler: seq_len must be >= 1");
  const uint64_t windows = data->size() > 0 ? (data->size() - 1) / options.seq_len : 0;
  if (options.global_batch > 0 && windows < options.global_batch) {
    return InvalidArgumentError(fmt::format(
        "{}: {} tokens hold {} sequences of {}+1 tokens, fewer than the global batch of {} "
        "sequences (needs at least {} tokens)",
        data->path(), data->size(), windows, options.seq_len, options.global_batch,
        options.global_batch * options.seq_len + 1));
  }
  STRATA_ASSIGN_OR_RETURN(SequenceSampler s, Create(windows, data->path(), options));
  s.data_ = data;
  return s;
}

Result<SequenceSampler> SequenceSampler::Create(uint64_t num_windows, std::string name,
                                                const SamplerOptions& options) {
  if (options.seq_len == 0) return InvalidArgumentError("sequence sampler: seq_len must be >= 1");
  if (options.global_batch == 0) {
    return InvalidArgumentError("sequence sampler: global batch must be >= 1 sequence");
  }
  if (num_windows < options.global_batch) {
    return InvalidArgumentError(
        fmt::format("{}: {} rows of {}+1 tokens, fewer than the global batch of {} sequences",
                    name, num_windows, options.seq_len, options.global_batch));
  }
  SequenceSampler s;
  s.name_ = std::move(name);
  s.options_ = options;
  s.num_windows_ = num_windows;
  return s;
}

Result<StepStart> SequenceSampler::StartOf(uint64_t step) const {
  if (step < origin_step_) {
    return OutOfRangeError(
        fmt::format("data order for step {} is unknown: the sampler was restored at step {}", step,
                    origin_step_));
  }
  return Walk(origin_, step - origin_step_, options_.global_batch, num_windows_);
}

uint64_t SequenceSampler::SampleWindow(uint64_t epoch, uint64_t position) const {
  if (options_.mode == SamplingMode::kSequential) return position;
  return PermuteWindow(options_.seed, epoch, num_windows_, position);
}

Result<std::vector<uint64_t>> SequenceSampler::GlobalBatchWindows(uint64_t step) const {
  STRATA_ASSIGN_OR_RETURN(StepStart start, StartOf(step));
  std::vector<uint64_t> windows(options_.global_batch);
  for (uint64_t b = 0; b < options_.global_batch; ++b)
    windows[b] = SampleWindow(start.epoch, start.position + b);
  return windows;
}

Status SequenceSampler::ReadGlobalBatch(uint64_t step, std::span<int32_t> out) const {
  if (data_ == nullptr) {
    return FailedPreconditionError(fmt::format("{}: this sampler orders rows it does not read",
                                               name_));
  }
  const uint64_t row = tokens_per_sequence();
  if (out.size() != options_.global_batch * row) {
    return InvalidArgumentError(fmt::format("ReadGlobalBatch: buffer holds {} tokens, expected {}",
                                            out.size(), options_.global_batch * row));
  }
  STRATA_ASSIGN_OR_RETURN(StepStart start, StartOf(step));
  for (uint64_t b = 0; b < options_.global_batch; ++b) {
    const uint64_t w = SampleWindow(start.epoch, start.position + b);
    STRATA_RETURN_IF_ERROR(data_->Read(w * options_.seq_len, out.subspan(b * row, row)));
  }
  return Status::Ok();
}

Result<std::vector<uint64_t>> SequenceSampler::RankWindows(uint64_t step,
                                                           const BatchLayout& layout, int rank,
                                                           int accum_index) const {
  STRATA_RETURN_IF_ERROR(ValidateBatchLayout(layout));
  if (layout.global_batch() != options_.global_batch) {
    return InvalidArgumentError(fmt::format(
        "batch layout {} ranks x {} sequences x {} micro-steps = {} sequences, but the sampler's "
        "global batch is {}",
        layout.world_size, layout.micro_batch, layout.grad_accum, layout.global_batch(),
        options_.global_batch));
  }
  if (rank < 0 || rank >= layout.world_size || accum_index < 0 ||
      accum_index >= layout.grad_accum) {
    return InvalidArgumentError(
        fmt::format("rank {} / micro-step {} is outside {} ranks x {} "
                    "micro-steps",
                    rank, accum_index, layout.world_size, layout.grad_accum));
  }
  STRATA_ASSIGN_OR_RETURN(StepStart start, StartOf(step));
  std::vector<uint64_t> windows(static_cast<size_t>(layout.micro_batch));
  for (size_t i = 0; i < windows.size(); ++i) {
    const uint64_t b = GlobalBatchIndex(layout, rank, accum_index, static_cast<int>(i));
    windows[i] = SampleWindow(start.epoch, start.position + b);
  }
  return windows;
}

Status SequenceSampler::ReadRankBatch(uint64_t step, const BatchLayout& layout, int rank,
                                      int accum_index, std::span<int32_t> out) const {
  if (data_ == nullptr) {
    return FailedPreconditionError(fmt::format("{}: this sampler orders rows it does not read",
                                               name_));
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<uint64_t> windows,
                          RankWindows(step, layout, rank, accum_index));
  const uint64_t row = tokens_per_sequence();
  if (out.size() != windows.size() * row) {
    return InvalidArgumentError(fmt::format("ReadRankBatch: buffer holds {} tokens, expected {}",
                                            out.size(), windows.size() * row));
  }
  for (size_t i = 0; i < windows.size(); ++i) {
    STRATA_RETURN_IF_ERROR(data_->Read(windows[i] * options_.seq_len, out.subspan(i * row, row)));
  }
  return Status::Ok();
}

SamplerState SequenceSampler::state() const {
  const StepStart start = Walk(origin_, step_ - origin_step_, options_.global_batch, num_windows_);
  SamplerState s;
  s.step = step_;
  s.epoch = start.epoch;
  s.position = start.position;
  s.seq_len = options_.seq_len;
  s.num_windows = num_windows_;
  s.seed = options_.seed;
  s.mode = options_.mode;
  return s;
}

Status SequenceSampler::Restore(const SamplerState& state) {
  std::string mismatch;
  if (state.seq_len != options_.seq_len) {
    mismatch = fmt::format("seq_len {} (now {})", state.seq_len, options_.seq_len);
  } else if (state.num_windows != num_windows_) {
    mismatch = fmt::format("{} sequences in the data (now {}: a different dataset or seq_len?)",
                           state.num_windows, num_windows_);
  } else if (state.seed != options_.seed) {
    mismatch = fmt::format("seed {} (now {})", state.seed, options_.seed);
  } else if (state.mode != options_.mode) {
    mismatch = fmt::format("sampling {} (now {})", SamplingModeName(state.mode),
                           SamplingModeName(options_.mode));
  }
  if (!mismatch.empty()) {
    return FailedPreconditionError(fmt::format(
        "{}: cannot resume the data order: the saved state has {}", name_, mismatch));
  }
  if (state.position >= num_windows_) {
    return FailedPreconditionError(
        fmt::format("{}: saved data position {} is past the {} sequences of an epoch",
                    name_, state.position, num_windows_));
  }
  origin_step_ = state.step;
  // A saved position with too few sequences left for the (possibly new) global batch starts the
  // next epoch, exactly as an uninterrupted run would have.
  if (num_windows_ - state.position < options_.global_batch) {
    origin_ = {state.epoch + 1, 0};
  } else {
    origin_ = {state.epoch, state.position};
  }
  step_ = state.step;
  return Status::Ok();
}

// ---- Synthetic corpus --------------------------------------------------------------------------

namespace {
// Cumulative successor probabilities 0.5, 0.25, 0.15, 0.10 and the noise probability 0.05, in
// units of 2^-32 so that sampling is integer arithmetic.
constexpr uint64_t kUnit = uint64_t{1} << 32;
constexpr uint64_t kSuccessorCdf[kSynthSuccessors] = {kUnit / 2, kUnit * 3 / 4, kUnit * 9 / 10,
                                                      kUnit};
constexpr uint64_t kNoise = kUnit / 20;
}  // namespace

SyntheticTokenGenerator::SyntheticTokenGenerator(uint64_t vocab, uint64_t seed)
    : vocab_(std::max<uint64_t>(vocab, 1)),
      seed_(seed),
      rng_state_(Mix(seed, 0x5eed)),
      current_(static_cast<uint32_t>(SplitMix64(seed) % std::max<uint64_t>(vocab, 1))) {}

uint32_t SyntheticTokenGenerator::Successor(uint32_t token, int j) const {
  const uint64_t h = Mix(seed_, (uint64_t{token} << 3) | static_cast<uint64_t>(j));
  return static_cast<uint32_t>(h % vocab_);
}

void SyntheticTokenGenerator::Generate(std::span<uint32_t> out) {
  for (uint32_t& token : out) {
    if (!started_) {
      started_ = true;
      token = current_;
      continue;
    }
    rng_state_ += 0x9e3779b97f4a7c15ull;
    const uint64_t r = SplitMix64(rng_state_);
    const uint64_t choice = r >> 32;          // what happens: noise or which successor
    const uint64_t pick = r & 0xffffffffull;  // noise token / successor draw
    if (choice < kNoise) {
      current_ = static_cast<uint32_t>((pick * vocab_) >> 32);
    } else {
      int j = 0;
      while (j < kSynthSuccessors - 1 && pick >= kSuccessorCdf[j])
        ++j;
      current_ = Successor(current_, j);
    }
    token = current_;
  }
}

Status WriteSyntheticCorpus(const std::string& path, const SynthOptions& options,
                            const SynthProgress& progress) {
  if (options.tokens == 0) return InvalidArgumentError("--tokens must be at least 1");
  if (options.vocab < 1 || options.vocab > kMaxVocabSize) {
    return InvalidArgumentError(
        fmt::format("--vocab {} is not in [1, {}]", options.vocab, kMaxVocabSize));
  }
  if (options.dtype == TokenDtype::kUint16 && options.vocab > 65536) {
    return InvalidArgumentError(fmt::format(
        "--vocab {} does not fit --dtype uint16 (at most 65536); use uint32", options.vocab));
  }
  STRATA_ASSIGN_OR_RETURN(TokenFileWriter writer,
                          TokenFileWriter::Create(path, options.dtype, options.tokens));
  SyntheticTokenGenerator gen(options.vocab, options.seed);
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<uint32_t> chunk(std::min(kChunk, options.tokens));
  uint64_t done = 0;
  while (done < options.tokens) {
    const uint64_t n = std::min<uint64_t>(chunk.size(), options.tokens - done);
    std::span<uint32_t> part(chunk.data(), n);
    gen.Generate(part);
    STRATA_RETURN_IF_ERROR(writer.Append(part));
    done += n;
    if (progress) progress(done, options.tokens);
  }
  return writer.Commit();
}

}  // namespace strata::train
