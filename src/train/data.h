// Token data for training: a pre-tokenized 1-D token stream on disk, the sampler that cuts it into
// training sequences for each rank and step, a writer for token files, and a synthetic corpus.
//
// File formats (TokenDataset::Open picks one by the file name's extension):
//   .npy   a NumPy array file, format version 1.0, 2.0 or 3.0; the header must describe a 1-D
//          array ('shape': (N,)) of dtype '<u2' (uint16), '<u4' (uint32) or '<i4' (int32).
//          A 1-D array is laid out the same in C and Fortran order, so 'fortran_order' may be
//          either.
//   other  (.bin, ...) raw little-endian tokens with no header, of the dtype the caller names;
//          the file size must be a whole number of tokens.
// Token ids are handed out as int32_t (what an embedding lookup takes); vocab_size is at most
// 2^31 - 1. An id outside [0, vocab_size) is an error when the sequence holding it is read.
//
// The training-order contract (what a single-process reference, e.g. PyTorch, must do to see the
// same global batch as Strata on any number of ranks) is documented above SequenceSampler.
//
// Thread safety: TokenDataset::Read and every const method of SequenceSampler may be called from
// several threads at once (they use pread and keep no shared cursor). Non-const methods (Advance,
// Restore, TokenFileWriter::*) need external synchronisation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata::train {

enum class TokenDtype { kUint16, kUint32, kInt32 };

// "uint16", "uint32", "int32".
std::string_view TokenDtypeName(TokenDtype dtype);
// Parses a TokenDtypeName; any other text is InvalidArgument listing the accepted names.
Result<TokenDtype> ParseTokenDtype(std::string_view name);
// Bytes per token: 2 or 4.
size_t TokenDtypeSize(TokenDtype dtype);

// The largest vocabulary a token id (int32_t) can index.
inline constexpr uint64_t kMaxVocabSize = 0x7fffffff;

// A read-only 1-D token stream in a file. Never loads the whole file: Read() reads the range it
// is asked for (through the file seam, strata/file_system.h). Move-only; owns the open file.
class TokenDataset {
 public:
  // Opens `path` and validates its header and size (see the file comment for the formats).
  // `bin_dtype` is the dtype of a headerless file and is ignored for .npy. `vocab_size` in
  // [1, kMaxVocabSize] is the bound that Read checks ids against.
  // Errors name the file and what is wrong: NotFound / PermissionDenied (open), InvalidArgument
  // (bad magic or header, unsupported dtype, not 1-D, a size that is not a whole number of
  // tokens, no tokens at all), DataLoss (the file is shorter than its header says).
  static Result<TokenDataset> Open(const std::string& path, uint64_t vocab_size,
                                   TokenDtype bin_dtype = TokenDtype::kUint16,
                                   FileSystem& fs = LocalFileSystem());

  TokenDataset(TokenDataset&& other) noexcept;
  TokenDataset& operator=(TokenDataset&& other) noexcept;
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;
  ~TokenDataset();

  const std::string& path() const { return path_; }
  TokenDtype dtype() const { return dtype_; }
  bool is_npy() const { return is_npy_; }
  uint64_t vocab_size() const { return vocab_size_; }
  // Number of tokens in the stream.
  uint64_t size() const { return num_tokens_; }
  // Byte offset of token 0 in the file (the .npy header length; 0 for raw files).
  uint64_t data_offset() const { return data_offset_; }

  // Reads tokens [start, start + out.size()) into `out` and checks every id.
  // OutOfRange when the range passes the end of the stream; InvalidArgument naming the file, the
  // token's position in the stream and its value when an id is negative or >= vocab_size;
  // DataLoss when the file has shrunk since Open; other I/O errors via errno.
  Status Read(uint64_t start, std::span<int32_t> out) const;

 private:
  TokenDataset() = default;

  std::string path_;
  std::unique_ptr<File> file_;
  TokenDtype dtype_ = TokenDtype::kUint16;
  bool is_npy_ = false;
  uint64_t vocab_size_ = 0;
  uint64_t num_tokens_ = 0;
  uint64_t data_offset_ = 0;
};

// Writes a token file atomically: tokens go to a temporary file beside `path`
// ("<path>.tmp.<pid>"); Commit() fsyncs it, renames it to `path` and fsyncs the directory. If
// the writer is destroyed without a successful Commit, the temporary file is removed and `path`
// is untouched. The format follows the extension of `path` (.npy: a version 1.0 header written
// up front, so the token count must be known; anything else: raw little-endian tokens).
class TokenFileWriter {
 public:
  // `num_tokens` is the exact number of tokens that will be appended (checked by Commit).
  static Result<TokenFileWriter> Create(const std::string& path, TokenDtype dtype,
                                        uint64_t num_tokens, FileSystem& fs = LocalFileSystem());

  TokenFileWriter(TokenFileWriter&& other) noexcept;
  TokenFileWriter& operator=(TokenFileWriter&& other) noexcept;
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  ~TokenFileWriter();

  // Appends tokens. InvalidArgument when a value does not fit the dtype (e.g. 70000 as uint16)
  // or more than num_tokens would be written; I/O errors (ENOSPC, ...) name the file.
  Status Append(std::span<const uint32_t> tokens);
  // Finishes the file (see the class comment). FailedPrecondition when fewer than num_tokens
  // were appended.
  Status Commit();

  const std::string& path() const { return path_; }
  // Bytes the finished file has (header + tokens).
  uint64_t file_bytes() const;

 private:
  TokenFileWriter() = default;
  void Abandon();

  FileSystem* fs_ = nullptr;
  std::string path_;
  std::string temp_path_;
  std::unique_ptr<File> file_;  // null once committed or abandoned
  TokenDtype dtype_ = TokenDtype::kUint16;
  uint64_t header_bytes_ = 0;
  uint64_t num_tokens_ = 0;
  uint64_t written_ = 0;
  std::vector<char> buffer_;
};

// The header a .npy file of `num_tokens` tokens of `dtype` starts with (format version 1.0,
// padded with spaces to a multiple of 64 bytes, ending in '\n').
std::string NpyHeader(TokenDtype dtype, uint64_t num_tokens);

// ------------------------------------------------------------------------------------------------
// Sampling: how sequences are cut from the stream and handed to ranks.
//
// Windows. With sequence length T, the stream of N tokens holds W = floor((N - 1) / T)
// non-overlapping windows; window w is tokens [w*T, w*T + T + 1): T inputs followed by one more
// token so the targets are the inputs shifted by one (window w's last token is window w+1's first).
// Tokens after the last window are not used.
//
// Epochs. The sampler walks the windows in an order fixed for each epoch:
//   kSequential  epoch e visits windows 0, 1, ..., W-1 (the same for every epoch);
//   kRandom      epoch e visits window PermuteWindow(seed, e, W, k) at position k, a seeded
//                pseudo-random bijection of [0, W) that differs per epoch (a 4-round Feistel
//                network keyed by SplitMix64(seed, epoch), cycle-walked into [0, W)). It needs no
//                memory and does not depend on anything that happened before.
//
// Steps. A step consumes a global batch of G = world_size * micro_batch * grad_accum sequences,
// the next G positions of the current epoch. A step never straddles two epochs: when fewer than
// G positions are left in an epoch, they are skipped and the step starts the next epoch at
// position 0. So with a fixed G every epoch holds floor(W / G) steps, and the G windows of a step
// are distinct (disjoint across ranks and micro-steps) because a permutation never repeats
// within an epoch. G must not exceed W.
//
// Global batch. GlobalBatchWindows(step)[b], b in [0, G), is the window at position p + b of
// epoch e, where (e, p) is where the step starts. It depends only on (dataset size, T, seed,
// sampling, G, step) and the state the sampler was restored from — not on the world size.
//
// Rank slice. Rank r's micro-step a (0 <= a < grad_accum), row i (0 <= i < micro_batch) is global
// batch index
//     b = (a * world_size + r) * micro_batch + i
// i.e. each micro-step takes the next world_size * micro_batch sequences of the global batch and
// rank r takes its r-th contiguous run of micro_batch of them. The union over ranks and
// micro-steps is the whole global batch, whatever the world size; a single-process reference
// reproduces a step by reading GlobalBatchWindows(step) (or SampleWindow below) in order b.
// ------------------------------------------------------------------------------------------------

enum class SamplingMode { kSequential, kRandom };

// "sequential", "random".
std::string_view SamplingModeName(SamplingMode mode);
Result<SamplingMode> ParseSamplingMode(std::string_view name);

// The pseudo-random bijection of [0, num_windows) used by kRandom for `epoch` (see above).
uint64_t PermuteWindow(uint64_t seed, uint64_t epoch, uint64_t num_windows, uint64_t position);

// How a global batch is split into ranks and micro-steps.
struct BatchLayout {
  int world_size = 1;
  int micro_batch = 1;  // sequences per rank per micro-step
  int grad_accum = 1;   // micro-steps per step
  uint64_t global_batch() const {
    return static_cast<uint64_t>(world_size) * static_cast<uint64_t>(micro_batch) *
           static_cast<uint64_t>(grad_accum);
  }
};

// InvalidArgument unless every field is >= 1.
Status ValidateBatchLayout(const BatchLayout& layout);

// The global batch index of rank `rank`'s micro-step `accum_index`, row `row` (see the contract).
inline uint64_t GlobalBatchIndex(const BatchLayout& layout, int rank, int accum_index, int row) {
  return (static_cast<uint64_t>(accum_index) * static_cast<uint64_t>(layout.world_size) +
          static_cast<uint64_t>(rank)) *
             static_cast<uint64_t>(layout.micro_batch) +
         static_cast<uint64_t>(row);
}

struct SamplerOptions {
  uint64_t seq_len = 0;       // T: input tokens per sequence (a sequence holds T + 1 tokens)
  uint64_t global_batch = 0;  // G: sequences per step (BatchLayout::global_batch())
  SamplingMode mode = SamplingMode::kRandom;
  uint64_t seed = 0;
};

// What a checkpoint saves to resume the data exactly: the next step and where it starts, plus
// what the order depends on (checked on Restore).
struct SamplerState {
  uint64_t step = 0;      // the next step to run
  uint64_t epoch = 0;     // the epoch `step` starts in
  uint64_t position = 0;  // its first position within that epoch
  // Fingerprint of the order: Restore refuses a state taken with a different one.
  uint64_t seq_len = 0;
  uint64_t num_windows = 0;
  uint64_t seed = 0;
  SamplingMode mode = SamplingMode::kRandom;

  friend bool operator==(const SamplerState&, const SamplerState&) = default;
};

// Where a step starts.
struct StepStart {
  uint64_t epoch = 0;
  uint64_t position = 0;
};

class SequenceSampler {
 public:
  // `data` must outlive the sampler. InvalidArgument when seq_len or global_batch is 0 or the
  // stream holds fewer than global_batch windows of seq_len + 1 tokens (the message names the
  // file, its token count and what is needed).
  static Result<SequenceSampler> Create(const TokenDataset* data, const SamplerOptions& options);
  // A sampler over `num_windows` rows that something else reads (train/training_data.h: packed
  // documents); `name` (the data's path) is what its errors name. ReadGlobalBatch and
  // ReadRankBatch are FailedPrecondition on it: read RankWindows' rows instead.
  static Result<SequenceSampler> Create(uint64_t num_windows, std::string name,
                                        const SamplerOptions& options);

  uint64_t seq_len() const { return options_.seq_len; }
  uint64_t global_batch() const { return options_.global_batch; }
  // Sequence length plus the target token.
  uint64_t tokens_per_sequence() const { return options_.seq_len + 1; }
  uint64_t num_windows() const { return num_windows_; }
  uint64_t steps_per_epoch() const { return num_windows_ / options_.global_batch; }
  const SamplerOptions& options() const { return options_; }
  const TokenDataset& dataset() const { return *data_; }

  // Where `step` starts. Steps before the one the sampler was created or restored at are
  // OutOfRange (the order before a restore with a different global batch is not known).
  Result<StepStart> StartOf(uint64_t step) const;
  // The window at `position` of `epoch` (sequential or permuted).
  uint64_t SampleWindow(uint64_t epoch, uint64_t position) const;
  // The G windows of `step`, in global batch order b.
  Result<std::vector<uint64_t>> GlobalBatchWindows(uint64_t step) const;

  // Rank `rank`'s micro-step `accum_index` of `step`: the windows of its micro_batch rows, in
  // order (the contract above).
  Result<std::vector<uint64_t>> RankWindows(uint64_t step, const BatchLayout& layout, int rank,
                                            int accum_index) const;

  // The whole global batch of `step`: G rows of seq_len + 1 tokens, row b at
  // out[b * (seq_len + 1)]. `out` must hold exactly G * (seq_len + 1) tokens.
  Status ReadGlobalBatch(uint64_t step, std::span<int32_t> out) const;
  // Rank `rank`'s micro-step `accum_index` of `step`: micro_batch rows of seq_len + 1 tokens.
  // `layout.global_batch()` must equal global_batch(); `out` must hold exactly
  // micro_batch * (seq_len + 1) tokens.
  Status ReadRankBatch(uint64_t step, const BatchLayout& layout, int rank, int accum_index,
                       std::span<int32_t> out) const;

  // The cursor a trainer keeps: the next step to run.
  uint64_t step() const { return step_; }
  void Advance() { ++step_; }
  // The state to checkpoint (describes step()).
  SamplerState state() const;
  // Continues from a saved state: step() becomes state.step and the order from there on is what
  // the saving sampler would have produced — also after a change of global batch (the new G
  // applies from state.step on). FailedPrecondition when seq_len, seed, mode or the number of
  // windows (i.e. the dataset) differ from this sampler's, or the position is past the epoch.
  Status Restore(const SamplerState& state);

 private:
  SequenceSampler() = default;

  const TokenDataset* data_ = nullptr;  // null: rows someone else reads
  std::string name_;                     // the data's path, for messages
  SamplerOptions options_;
  uint64_t num_windows_ = 0;
  // The step the order is anchored at (0, or the restored step) and where it starts.
  uint64_t origin_step_ = 0;
  StepStart origin_;
  uint64_t step_ = 0;
};

// ------------------------------------------------------------------------------------------------
// Synthetic corpus: a learnable token stream for smoke tests and loss-curve checks.
//
// A fixed sparse Markov chain over [0, vocab): every token t has kSynthSuccessors = 4 successor
// tokens s_j(t) = SplitMix64(seed, t, j) mod vocab, chosen with probabilities 0.5, 0.25, 0.15,
// 0.10. Each next token is, with probability 0.05, a uniformly random token instead (noise, so
// every bigram has some mass); otherwise a successor of the current token. The first token is
// SplitMix64(seed) mod vocab. The per-token entropy of the next token given the current one is
// about 0.95 * 1.74 bits + H(0.05) + 0.05 * log2(vocab) — about 2.7 bits (1.9 nats) at vocab 32000
// against log2(32000) = 15 bits for a uniform guess — so a small model's loss falls from
// ln(vocab) towards ~1.9 nats as it learns the bigram table. All arithmetic is integer (SplitMix64
// streams), so the output is the same on every platform for a given (seed, vocab).
// ------------------------------------------------------------------------------------------------

inline constexpr int kSynthSuccessors = 4;

class SyntheticTokenGenerator {
 public:
  // vocab in [1, kMaxVocabSize].
  SyntheticTokenGenerator(uint64_t vocab, uint64_t seed);
  // Fills `out` with the next tokens of the stream.
  void Generate(std::span<uint32_t> out);
  // Successor j of token t.
  uint32_t Successor(uint32_t token, int j) const;

 private:
  uint64_t vocab_;
  uint64_t seed_;
  uint64_t rng_state_;
  uint32_t current_;
  bool started_ = false;
};

struct SynthOptions {
  uint64_t tokens = 0;  // >= 1
  uint64_t vocab = 0;   // [1, kMaxVocabSize]; <= 65536 for uint16
  uint64_t seed = 1;
  TokenDtype dtype = TokenDtype::kUint16;
};

// Called now and then with (tokens written, total).
using SynthProgress = std::function<void(uint64_t done, uint64_t total)>;

// Writes a synthetic corpus to `path` (.npy or raw by extension) atomically via TokenFileWriter.
// InvalidArgument for bad options (each naming the value and the bound); I/O errors name `path`.
Status WriteSyntheticCorpus(const std::string& path, const SynthOptions& options,
                            const SynthProgress& progress = nullptr);

}  // namespace strata::train
