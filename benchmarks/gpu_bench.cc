// strata_gpu_bench: GPU micro-benchmarks that need no training path. Each subcommand is the
// counterpart of a measurement that benchmarks/gpu_peers.py takes through PyTorch on the same
// machine, with the same sizes, the same timing method and the same JSON shape, so that a script
// (deploy/gpu-check.sh) can divide one by the other.
//
//   copy   host<->device bandwidth through Strata's pinned pool: the host side is blocks of a
//          device::PinnedPool registered with the device, the device side is Device::Alloc
//          memory. --bytes per measurement move as --chunk-sized CopyAsync calls. Modes:
//            h2d   host -> device on one stream;
//            d2h   device -> host on another;
//            both  the two at once (separate host and device buffers), each on its stream;
//                  reported as the combined rate (2 x --bytes over the time until both are done)
//                  and each direction's rate (--bytes over the time until that stream is done).
//          Before timing, every device buffer makes one round trip (h2d, d2h into another
//          block) and must come back byte for byte.
//   adam   the fused AdamW step (optim::DeviceAdamStep) over --params fp32 elements in device
//          memory: fp32 (master, grad, m, v: the work of torch's fused AdamW on an fp32
//          parameter) and fp32+bf16 (also writing the bf16 copy). Bytes per step counted as
//          read master, grad, m, v (16 B/param) + write master, m, v (12 B) + the bf16 copy (2 B).
//          Before timing, one step of each variant from known inputs is compared bit for bit with
//          CpuAdamStep(Isa::kScalar) on host copies of those inputs (the CUDA kernel's oracle; on
//          the CPU device the check steps run the scalar path too).
//   attention  the decoder's causal grouped-query attention (the model's ops: on CUDA, the
//          tensor-core kernels for bf16/fp16 and head_dim 64 or 128, else the exact ones),
//          forward alone, then forward + backward, on fp32 activations in the model's
//          [batch, seq, heads, head_dim] layout with --dtype as the precision (--activations
//          bf16/fp16: q, k, v, out and the gradients in --dtype, as the model keeps them with
//          16-bit activations; cuDNN then needs no copies). TFLOP/s count
//          the causal pairs only: 4 b h d s(s+1)/2 for the forward, 3.5 times that for
//          forward + backward (the backward's five products against two). The output and dq
//          must be finite.
//
// Timing, on both sides: the host clock from before the first enqueue to after Synchronize of
// every stream involved; the median over --reps measurements after --warmup untimed ones (adam:
// each measurement is a batch of --batch steps, divided by --batch). Rates are decimal GB/s
// (1e9 bytes/s), the unit in which PCIe and HBM limits are quoted.
//
// --device cpu runs the same code on the CPU device (copies are memcpy on its stream threads),
// which is how it is tested on machines without a GPU. Every Status is checked: an error prints one
// line naming what failed and exits 1; bad options name the option. With --json, one JSON
// document goes to stdout and the table to stderr.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "bench_stats.h"
#include "common/host_memory.h"
#include "common/units.h"
#include "device/gpu_info.h"
#include "device/pinned_pool.h"
#include "model/llama_ops.h"
#include "optim/adam.h"
#include "optim/device_adam.h"
#include "strata/device.h"
#include "strata/status.h"

namespace strata::bench {
namespace {

using device::CopyKind;
using device::Device;
using device::PinnedBlock;
using device::PinnedPool;
using device::Stream;
using nlohmann::json;

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Min(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}

// splitmix64: a stateless hash, so that any byte or element of the test data can be regenerated
// from its index alone.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- options -----------------------------------------------------------------------------------

struct CommonArgs {
  std::string device = "cuda";
  int ordinal = 0;
  int reps = 10;
  int warmup = 2;
  bool json_output = false;
};

struct CopyArgs {
  std::string bytes_text = "1GiB";
  std::string chunk_text = "64MiB";
  std::vector<std::string> modes = {"h2d", "d2h", "both"};
  // Parsed.
  uint64_t bytes = 0;
  uint64_t chunk = 0;
};

struct AdamArgs {
  int64_t params = int64_t{1} << 27;  // signed, so that a negative value is an error, not 2^64 - k
  int batch = 10;
  int cpu_threads = 1;
};

struct AttentionArgs {
  int64_t batch = 1, seq = 2048, heads = 16, kv_heads = 8, head_dim = 128;
  std::string dtype = "bf16";
  std::string activations = "fp32";  // or --dtype's 16-bit dtype (CUDA)
};

Status CheckCommon(const CommonArgs& a) {
  if (a.reps < 1)
    return InvalidArgumentError(fmt::format("--reps {}: expected at least 1", a.reps));
  if (a.warmup < 0) {
    return InvalidArgumentError(fmt::format("--warmup {}: expected 0 or more", a.warmup));
  }
  if (a.ordinal < 0) {
    return InvalidArgumentError(fmt::format("--ordinal {}: expected a GPU index >= 0", a.ordinal));
  }
  return Status::Ok();
}

Status ParseCopyArgs(CopyArgs& a) {
  Result<uint64_t> bytes = ParseByteSize(a.bytes_text);
  if (!bytes.ok()) return bytes.status().WithContext("--bytes");
  Result<uint64_t> chunk = ParseByteSize(a.chunk_text);
  if (!chunk.ok()) return chunk.status().WithContext("--chunk");
  a.bytes = *bytes;
  a.chunk = *chunk;
  if (a.bytes == 0) {
    return InvalidArgumentError(
        fmt::format("--bytes {}: expected a positive byte count (e.g. 1GiB)", a.bytes_text));
  }
  if (a.chunk == 0 || a.chunk > a.bytes) {
    return InvalidArgumentError(
        fmt::format("--chunk {}: expected a positive byte count no larger than --bytes ({} B)",
                    a.chunk_text, a.bytes));
  }
  // Keep the first occurrence of each mode, in the order given.
  std::vector<std::string> modes;
  for (const std::string& mode : a.modes) {
    if (std::find(modes.begin(), modes.end(), mode) == modes.end()) modes.push_back(mode);
  }
  if (modes.empty()) return InvalidArgumentError("--modes: expected at least one of h2d,d2h,both");
  a.modes = std::move(modes);
  return Status::Ok();
}

Status CheckAdamArgs(const AdamArgs& a) {
  if (a.params < 1 || a.params > (int64_t{1} << 40)) {
    return InvalidArgumentError(
        fmt::format("--params {}: expected 1 to 2^40 fp32 elements", a.params));
  }
  if (a.batch < 1) {
    return InvalidArgumentError(fmt::format("--batch {}: expected at least 1 step", a.batch));
  }
  if (a.cpu_threads < 1) {
    return InvalidArgumentError(
        fmt::format("--cpu-threads {}: expected at least 1", a.cpu_threads));
  }
  return Status::Ok();
}

Status CheckAttentionArgs(const AttentionArgs& a) {
  const std::pair<const char*, int64_t> positive[] = {{"--batch", a.batch},
                                                      {"--seq", a.seq},
                                                      {"--heads", a.heads},
                                                      {"--kv-heads", a.kv_heads},
                                                      {"--head-dim", a.head_dim}};
  for (const auto& [name, value] : positive) {
    if (value < 1 || value > (int64_t{1} << 20)) {
      return InvalidArgumentError(fmt::format("{} {}: expected 1 to 2^20", name, value));
    }
  }
  if (a.activations != "fp32" && a.activations != a.dtype) {
    return InvalidArgumentError(
        fmt::format("--activations {}: 16-bit activations must be in the precision (--dtype {})",
                    a.activations, a.dtype));
  }
  const double q_bytes = 4.0 * static_cast<double>(a.batch) * static_cast<double>(a.seq) *
                        static_cast<double>(a.heads) * static_cast<double>(a.head_dim);
  if (q_bytes > static_cast<double>(uint64_t{1} << 40)) {
    return InvalidArgumentError(fmt::format(
        "--batch {} --seq {} --heads {} --head-dim {}: q alone would take {:.0f} GB", a.batch,
        a.seq, a.heads, a.head_dim, q_bytes / 1e9));
  }
  if (a.heads % a.kv_heads != 0) {
    return InvalidArgumentError(fmt::format(
        "--heads {} is not a multiple of --kv-heads {}", a.heads, a.kv_heads));
  }
  if (a.head_dim % 2 != 0 || a.head_dim > 256) {
    return InvalidArgumentError(
        fmt::format("--head-dim {}: expected an even number up to 256", a.head_dim));
  }
  return Status::Ok();
}

// ---- device, memory, streams -------------------------------------------------------------------

Result<std::unique_ptr<Device>> OpenDevice(const CommonArgs& a) {
  device::DeviceOptions options;
  options.type = a.device == "cuda" ? device::DeviceType::kCuda : device::DeviceType::kCpu;
  options.ordinal = a.ordinal;
  Result<std::unique_ptr<Device>> created = device::CreateDevice(options);
  if (!created.ok()) return created.status().WithContext(fmt::format("--device {}", a.device));
  return created;
}

// What the JSON's "device" says: the GPU's model name (as torch.cuda.get_device_name reports it,
// so that both sides of a comparison name the same thing), else the Strata device's name.
std::string DeviceLabel(const Device& dev, int ordinal) {
  if (dev.type() == device::DeviceType::kCuda) {
    const device::GpuReport report = device::QueryGpus();
    for (const device::GpuInfo& gpu : report.gpus) {
      if (gpu.index == ordinal && !gpu.name.empty()) return gpu.name;
    }
  }
  return std::string(dev.name());
}

// "cuda:0 (NVIDIA H100 80GB HBM3)", or the device's name alone when the label is that name.
std::string Described(const Device& dev, const std::string& label) {
  if (label == dev.name()) return label;
  return fmt::format("{} ({})", dev.name(), label);
}

// Memory from Device::Alloc, freed on destruction. No enqueued work may use it by then: each
// benchmark declares a StreamDrain after its buffers, whose destructor runs first.
class DeviceBuffer {
 public:
  static Result<DeviceBuffer> Allocate(Device& dev, size_t bytes, std::string_view what) {
    Result<void*> ptr = dev.Alloc(bytes);
    if (!ptr.ok()) {
      return ptr.status().WithContext(
          fmt::format("device memory for {} ({})", what, FormatBytes(bytes)));
    }
    return DeviceBuffer(&dev, static_cast<char*>(*ptr));
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : dev_(other.dev_), ptr_(std::exchange(other.ptr_, nullptr)) {}
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) dev_->Free(ptr_);
  }
  char* data() const { return ptr_; }

 private:
  DeviceBuffer(Device* dev, char* ptr) : dev_(dev), ptr_(ptr) {}
  Device* dev_;
  char* ptr_;
};

// A block of the pinned pool, returned to it on destruction (the same rule as DeviceBuffer).
class PoolBlock {
 public:
  static Result<PoolBlock> Allocate(PinnedPool& pool, size_t bytes, std::string_view what) {
    Result<PinnedBlock> block = pool.Allocate(bytes);
    if (!block.ok()) {
      return block.status().WithContext(
          fmt::format("pinned block for {} ({})", what, FormatBytes(bytes)));
    }
    return PoolBlock(&pool, *block);
  }
  PoolBlock(PoolBlock&& other) noexcept
      : pool_(other.pool_), block_(std::exchange(other.block_, PinnedBlock{})) {}
  PoolBlock& operator=(PoolBlock&&) = delete;
  PoolBlock(const PoolBlock&) = delete;
  PoolBlock& operator=(const PoolBlock&) = delete;
  ~PoolBlock() {
    if (block_) pool_->Free(block_);
  }
  char* data() const { return static_cast<char*>(block_.data); }

 private:
  PoolBlock(PinnedPool* pool, PinnedBlock block) : pool_(pool), block_(block) {}
  PinnedPool* pool_;
  PinnedBlock block_;
};

// Synchronizes its streams on destruction, so that a benchmark that returns early on an error
// never frees memory that copies or kernels it enqueued still use.
class StreamDrain {
 public:
  StreamDrain(Device& dev, std::vector<Stream*> streams)
      : dev_(dev), streams_(std::move(streams)) {}
  StreamDrain(const StreamDrain&) = delete;
  StreamDrain& operator=(const StreamDrain&) = delete;
  ~StreamDrain() {
    // Errors were (or will be) reported by the code that enqueued the work; this only waits.
    for (Stream* stream : streams_)
      dev_.Synchronize(*stream).IgnoreError();
  }

 private:
  Device& dev_;
  std::vector<Stream*> streams_;
};

Result<std::unique_ptr<PinnedPool>> CreatePool(Device& dev, uint64_t bytes) {
  device::PinnedPoolOptions options;
  options.bytes = bytes;
  options.device = &dev;  // registered with the device (cudaHostRegister on CUDA); no store
  return PinnedPool::Create(options);
}

// A pool size that holds blocks of these sizes allocated in this order: each takes its size class,
// and one of at most PinnedPool::kRegisterChunk never crosses a multiple of it (the pool then
// starts it at the next multiple), as PinnedPool places blocks.
uint64_t PoolBytesFor(const std::vector<uint64_t>& requests) {
  uint64_t end = 0;
  for (const uint64_t request : requests) {
    const uint64_t capacity = PinnedPool::SizeClass(request);
    const uint64_t chunk = PinnedPool::kRegisterChunk;
    if (capacity <= chunk && end / chunk != (end + capacity - 1) / chunk) end = RoundUp(end, chunk);
    end += capacity;
  }
  return end;
}

json PoolJson(const PinnedPool& pool) {
  const device::PinnedPoolStats s = pool.stats();
  return {{"bytes", s.size},
          {"huge_page_bytes", s.huge_page_bytes},
          {"device_registered", s.device_registered}};
}

// Waits for each stream, each on its own thread (the first on the caller's), and returns the
// NowSeconds() at which each was seen complete.
Result<std::vector<double>> SynchronizeEach(Device& dev, const std::vector<Stream*>& streams) {
  std::vector<double> done(streams.size(), 0.0);
  std::vector<Status> status(streams.size());
  auto wait = [&](size_t k) {
    status[k] = dev.Synchronize(*streams[k]);
    done[k] = NowSeconds();
  };
  std::vector<std::thread> waiters;
  for (size_t k = 1; k < streams.size(); ++k)
    waiters.emplace_back(wait, k);
  wait(0);
  for (std::thread& t : waiters)
    t.join();
  for (size_t k = 0; k < streams.size(); ++k) {
    if (!status[k].ok()) return status[k];
  }
  return done;
}

// The table goes to stdout, or to stderr when stdout carries the JSON document.
template <typename... T>
void Say(bool json_output, fmt::format_string<T...> format, T&&... args) {
  fmt::print(json_output ? stderr : stdout, format, std::forward<T>(args)...);
}

// ---- copy --------------------------------------------------------------------------------------

// Fills `bytes` at `p` with a pattern that depends on `seed` and on each 8-byte word's position,
// so that a chunk landing at the wrong offset is caught, not only a wrong byte.
void FillPattern(char* p, uint64_t bytes, uint64_t seed) {
  const uint64_t words = bytes / 8;
  for (uint64_t i = 0; i < words; ++i) {
    const uint64_t w = Mix(seed ^ (i * 0x100000001B3ull));
    std::memcpy(p + 8 * i, &w, 8);
  }
  const uint64_t w = Mix(seed ^ (words * 0x100000001B3ull));
  std::memcpy(p + 8 * words, &w, bytes - 8 * words);
}

struct Direction {
  CopyKind kind;
  char* dst;
  const char* src;
  Stream* stream;
};

// Enqueues `bytes` of every direction as copies of at most `chunk` bytes, chunk k of each
// direction before chunk k + 1 of any, so that all directions run from the start.
Status EnqueueChunks(Device& dev, const std::vector<Direction>& directions, uint64_t bytes,
                     uint64_t chunk) {
  for (uint64_t offset = 0; offset < bytes; offset += chunk) {
    const uint64_t length = std::min(chunk, bytes - offset);
    for (const Direction& d : directions) {
      Status copied = dev.CopyAsync(d.dst + offset, d.src + offset, length, d.kind, *d.stream);
      if (!copied.ok()) {
        return copied.WithContext(fmt::format("{} copy of [{}, +{}) on stream '{}'",
                                              device::CopyKindName(d.kind), offset, length,
                                              d.stream->name()));
      }
    }
  }
  return Status::Ok();
}

// One measurement: seconds from before the first enqueue until each direction's stream is done.
Result<std::vector<double>> TimeCopies(Device& dev, const std::vector<Direction>& directions,
                                       uint64_t bytes, uint64_t chunk) {
  std::vector<Stream*> streams;
  for (const Direction& d : directions)
    streams.push_back(d.stream);
  const double t0 = NowSeconds();
  STRATA_RETURN_IF_ERROR(EnqueueChunks(dev, directions, bytes, chunk));
  STRATA_ASSIGN_OR_RETURN(std::vector<double> done, SynchronizeEach(dev, streams));
  for (double& t : done)
    t -= t0;
  return done;
}

// One round trip of `device_buffer`: `sent` -> device (h2d stream) -> `back` (d2h stream), which
// must then equal `sent` byte for byte. `back` is overwritten with another pattern first, so that
// a copy that did not happen cannot pass.
Status CheckRoundTrip(Device& dev, const char* sent, char* back, char* device_buffer, Stream& h2d,
                      Stream& d2h, uint64_t bytes, uint64_t chunk, std::string_view what) {
  FillPattern(back, bytes, 0xBAD5EEDull);
  STRATA_RETURN_IF_ERROR(EnqueueChunks(
      dev, {Direction{CopyKind::kHostToDevice, device_buffer, sent, &h2d}}, bytes, chunk));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(h2d));
  STRATA_RETURN_IF_ERROR(EnqueueChunks(
      dev, {Direction{CopyKind::kDeviceToHost, back, device_buffer, &d2h}}, bytes, chunk));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(d2h));
  if (std::memcmp(sent, back, bytes) == 0) return Status::Ok();
  uint64_t first = 0;
  while (first < bytes && sent[first] == back[first])
    ++first;
  uint64_t wrong = 0;
  for (uint64_t i = first; i < bytes; ++i)
    wrong += sent[i] != back[i] ? 1 : 0;
  return DataLossError(fmt::format(
      "copy check ({}): after h2d and d2h, byte {} of {} is {:#04x}, sent {:#04x} ({} bytes "
      "differ)",
      what, first, bytes, static_cast<unsigned>(static_cast<unsigned char>(back[first])),
      static_cast<unsigned>(static_cast<unsigned char>(sent[first])), wrong));
}

Status RunCopy(const CommonArgs& common, CopyArgs& args) {
  STRATA_RETURN_IF_ERROR(CheckCommon(common));
  STRATA_RETURN_IF_ERROR(ParseCopyArgs(args));
  const uint64_t bytes = args.bytes;
  const uint64_t chunk = args.chunk;
  const uint64_t chunks = (bytes + chunk - 1) / chunk;

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, OpenDevice(common));
  const std::string label = DeviceLabel(*dev, common.ordinal);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> h2d_stream, dev->CreateStream("h2d"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> d2h_stream, dev->CreateStream("d2h"));
  // Device memory first: the budget refuses an oversized run before the pool is faulted in.
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dev_dst,
                          DeviceBuffer::Allocate(*dev, bytes, "the h2d destination"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dev_src,
                          DeviceBuffer::Allocate(*dev, bytes, "the d2h source"));
  // Two host blocks (the h2d source, the d2h destination) of `bytes` each.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool,
                          CreatePool(*dev, PoolBytesFor({bytes, bytes})));
  STRATA_ASSIGN_OR_RETURN(PoolBlock host_src, PoolBlock::Allocate(*pool, bytes, "the h2d source"));
  STRATA_ASSIGN_OR_RETURN(PoolBlock host_dst,
                          PoolBlock::Allocate(*pool, bytes, "the d2h destination"));
  const StreamDrain drain(*dev, {h2d_stream.get(), d2h_stream.get()});

  // The check, which also gives both device buffers their data: one round trip each.
  FillPattern(host_src.data(), bytes, 0x5EED);
  STRATA_RETURN_IF_ERROR(CheckRoundTrip(*dev, host_src.data(), host_dst.data(), dev_dst.data(),
                                        *h2d_stream, *d2h_stream, bytes, chunk,
                                        "the h2d destination buffer"));
  STRATA_RETURN_IF_ERROR(CheckRoundTrip(*dev, host_src.data(), host_dst.data(), dev_src.data(),
                                        *h2d_stream, *d2h_stream, bytes, chunk,
                                        "the d2h source buffer"));

  const Direction h2d{CopyKind::kHostToDevice, dev_dst.data(), host_src.data(), h2d_stream.get()};
  const Direction d2h{CopyKind::kDeviceToHost, host_dst.data(), dev_src.data(), d2h_stream.get()};
  auto directions_of = [&](const std::string& mode) {
    if (mode == "h2d") return std::vector<Direction>{h2d};
    if (mode == "d2h") return std::vector<Direction>{d2h};
    return std::vector<Direction>{h2d, d2h};
  };

  Say(common.json_output,
      "strata_gpu_bench copy: device {}, {} per measurement as {} copies of at most {}, "
      "pinned pool {} ({} on huge pages, registered with the device), median of {} after {} "
      "warm-up\n",
      Described(*dev, label), FormatBytes(bytes), chunks, FormatBytes(chunk),
      FormatBytes(pool->size()), FormatBytes(pool->stats().huge_page_bytes), common.reps,
      common.warmup);

  // times[mode][direction]: per measurement, seconds until that direction's stream was done.
  const size_t modes = args.modes.size();
  std::vector<std::vector<std::vector<double>>> times(modes);
  for (size_t k = 0; k < modes; ++k)
    times[k].resize(directions_of(args.modes[k]).size());
  for (int round = 0; round < common.warmup + common.reps; ++round) {
    // Rotate which mode goes first, so that none always follows the same one.
    for (size_t j = 0; j < modes; ++j) {
      const size_t k = (j + static_cast<size_t>(round)) % modes;
      Result<std::vector<double>> done =
          TimeCopies(*dev, directions_of(args.modes[k]), bytes, chunk);
      if (!done.ok()) return done.status().WithContext(fmt::format("mode {}", args.modes[k]));
      if (round < common.warmup) continue;
      for (size_t d = 0; d < done->size(); ++d)
        times[k][d].push_back((*done)[d]);
    }
  }

  json results = json::object();
  Say(common.json_output, "{:<6}{:>10}{:>12}{:>12}{:>11}{:>11}\n", "mode", "GB/s", "median s",
      "min s", "h2d GB/s", "d2h GB/s");
  for (size_t k = 0; k < modes; ++k) {
    const std::string& mode = args.modes[k];
    const double b = static_cast<double>(bytes);
    if (times[k].size() == 1) {
      const double median = Median(times[k][0]);
      results[mode] = {
          {"gb_per_s", b / median / 1e9}, {"median_s", median}, {"min_s", Min(times[k][0])}};
      Say(common.json_output, "{:<6}{:>10.2f}{:>12.6f}{:>12.6f}\n", mode, b / median / 1e9, median,
          Min(times[k][0]));
      continue;
    }
    // both: the measurement ends when the later stream is done.
    std::vector<double> combined;
    for (size_t r = 0; r < times[k][0].size(); ++r)
      combined.push_back(std::max(times[k][0][r], times[k][1][r]));
    const double median = Median(combined);
    const double h2d_rate = b / Median(times[k][0]) / 1e9;
    const double d2h_rate = b / Median(times[k][1]) / 1e9;
    results[mode] = {{"gb_per_s", 2 * b / median / 1e9},
                     {"median_s", median},
                     {"min_s", Min(combined)},
                     {"h2d_gb_per_s", h2d_rate},
                     {"d2h_gb_per_s", d2h_rate},
                     {"h2d_median_s", Median(times[k][0])},
                     {"d2h_median_s", Median(times[k][1])}};
    Say(common.json_output, "{:<6}{:>10.2f}{:>12.6f}{:>12.6f}{:>11.2f}{:>11.2f}\n", mode,
        2 * b / median / 1e9, median, Min(combined), h2d_rate, d2h_rate);
  }
  Say(common.json_output, "data check: every device buffer made a round trip byte for byte\n");

  if (common.json_output) {
    const json doc = {{"bench", "copy"},
                      {"impl", "strata"},
                      {"device", label},
                      {"strata_device", std::string(dev->name())},
                      {"bytes", bytes},
                      {"chunk", chunk},
                      {"chunks", chunks},
                      {"reps", common.reps},
                      {"warmup", common.warmup},
                      {"pinned_pool", PoolJson(*pool)},
                      {"check", "round trip byte for byte"},
                      {"results", results}};
    fmt::print("{}\n", doc.dump());
  }
  return Status::Ok();
}

// ---- adam --------------------------------------------------------------------------------------

// The hyper-parameters of the peer: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
// weight_decay=0.01), bias correction on, steps counted from 1.
optim::AdamHyper PeerHyper() {
  optim::AdamHyper h;
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.01;
  h.decoupled = true;
  h.bias_correction = true;
  h.grad_scale = 1.0;
  h.step = 1;
  return h;
}

enum AdamArray : uint64_t { kMaster = 0, kGrad = 1, kM = 2, kV = 3 };
constexpr const char* kAdamArrayNames[] = {"master", "grad", "m", "v"};

// The initial value of element i of an array: a function of (array, i) alone, so that the host
// can regenerate the inputs of any element for the check. Every value is a normal fp32 number:
// master in [-1, 1), grad in [-0.1, 0.1), m in [-0.01, 0.01), v in [0, 1e-4).
float InitialValue(AdamArray array, uint64_t i) {
  const uint64_t h = Mix((i << 2) | array);
  const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  switch (array) {
    case kMaster:
      return 2.0f * u - 1.0f;
    case kGrad:
      return 0.2f * u - 0.1f;
    case kM:
      return 0.02f * u - 0.01f;
    case kV:
      return 1e-4f * u;
  }
  return 0.0f;
}

// Uploads InitialValue(array, 0..n) into `dst` through two pinned staging blocks: block k % 2 is
// refilled only after the copy that last read it completed.
Status UploadInitial(Device& dev, Stream& stream, char* const (&stage)[2],
                     device::Event* const (&done)[2], uint64_t stage_elements, AdamArray array,
                     float* dst, uint64_t n) {
  int k = 0;
  for (uint64_t begin = 0; begin < n; begin += stage_elements, k ^= 1) {
    const uint64_t count = std::min(stage_elements, n - begin);
    STRATA_RETURN_IF_ERROR(dev.Synchronize(*done[k]));
    auto* host = reinterpret_cast<float*>(stage[k]);
    for (uint64_t i = 0; i < count; ++i)
      host[i] = InitialValue(array, begin + i);
    STRATA_RETURN_IF_ERROR(
        dev.CopyAsync(dst + begin, host, count * sizeof(float), CopyKind::kHostToDevice, stream));
    STRATA_RETURN_IF_ERROR(dev.Record(*done[k], stream));
  }
  return Status::Ok();
}

// The elements the check compares: the head, the middle and the tail of the shard (all of it
// when small), as [begin, end) ranges that do not overlap.
struct Range {
  uint64_t begin;
  uint64_t end;
};
std::vector<Range> CheckRanges(uint64_t n) {
  constexpr uint64_t kSpan = 4096;
  if (n <= 3 * kSpan) return {{0, n}};
  return {{0, kSpan}, {n / 2 - kSpan / 2, n / 2 + kSpan / 2}, {n - kSpan, n}};
}

// Host copies of the checked elements, concatenated range after range. Elements of an Adam step
// are independent, so stepping the concatenation gives each element's result.
struct HostSample {
  std::vector<float> master, grad, m, v;
  std::vector<uint16_t> out16;
  optim::AdamShard Shard(bool with_out16) {
    return optim::AdamShard{master.data(),
                            grad.data(),
                            m.data(),
                            v.data(),
                            master.size(),
                            with_out16 ? out16.data() : nullptr,
                            device::DType::kBF16};
  }
};

HostSample InitialSample(const std::vector<Range>& ranges) {
  HostSample s;
  for (const Range& r : ranges) {
    for (uint64_t i = r.begin; i < r.end; ++i) {
      s.master.push_back(InitialValue(kMaster, i));
      s.grad.push_back(InitialValue(kGrad, i));
      s.m.push_back(InitialValue(kM, i));
      s.v.push_back(InitialValue(kV, i));
    }
  }
  s.out16.assign(s.master.size(), 0);
  return s;
}

// The element index of the j-th checked element.
uint64_t ElementOf(const std::vector<Range>& ranges, uint64_t j) {
  for (const Range& r : ranges) {
    if (j < r.end - r.begin) return r.begin + j;
    j -= r.end - r.begin;
  }
  return ~uint64_t{0};
}

struct DeviceShard {
  float* master;
  float* grad;
  float* m;
  float* v;
  uint16_t* out16;
  uint64_t n;
};

// Copies the checked elements of master, m, v and (with_out16) out16 from the device into
// `sample` (a pinned block laid out as master | m | v | out16, each holding every range in turn).
Status DownloadSample(Device& dev, Stream& stream, const DeviceShard& shard,
                      const std::vector<Range>& ranges, bool with_out16, char* sample) {
  struct Source {
    const void* base;
    size_t element_size;
  };
  std::vector<Source> sources = {{shard.master, 4}, {shard.m, 4}, {shard.v, 4}};
  if (with_out16) sources.push_back({shard.out16, 2});
  char* dst = sample;
  for (const Source& source : sources) {
    for (const Range& r : ranges) {
      const size_t length = (r.end - r.begin) * source.element_size;
      STRATA_RETURN_IF_ERROR(
          dev.CopyAsync(dst, static_cast<const char*>(source.base) + r.begin * source.element_size,
                        length, CopyKind::kDeviceToHost, stream));
      dst += length;
    }
  }
  return dev.Synchronize(stream);
}

// Compares `count` elements of `element_size` bytes bit for bit.
Status CompareBits(std::string_view variant, std::string_view array, const void* device_bits,
                   const void* host_bits, uint64_t count, size_t element_size,
                   const std::vector<Range>& ranges) {
  if (std::memcmp(device_bits, host_bits, count * element_size) == 0) return Status::Ok();
  const auto* d = static_cast<const unsigned char*>(device_bits);
  const auto* h = static_cast<const unsigned char*>(host_bits);
  uint64_t first = 0;
  uint64_t wrong = 0;
  bool found = false;
  for (uint64_t j = 0; j < count; ++j) {
    if (std::memcmp(d + j * element_size, h + j * element_size, element_size) != 0) {
      if (!found) first = j;
      found = true;
      ++wrong;
    }
  }
  auto describe = [&](const unsigned char* p) {
    if (element_size == 4) {
      uint32_t bits = 0;
      float value = 0;
      std::memcpy(&bits, p, 4);
      std::memcpy(&value, p, 4);
      return fmt::format("{:#010x} ({:.9g})", bits, value);
    }
    uint16_t bits = 0;
    std::memcpy(&bits, p, 2);
    return fmt::format("{:#06x} ({:.5g} as bf16)", bits, device::Bf16ToFloat(bits));
  };
  return InternalError(fmt::format(
      "adam check ({}): {}[{}] on the device is {}, the CPU scalar path gives {} ({} of {} "
      "checked elements differ)",
      variant, array, ElementOf(ranges, first), describe(d + first * element_size),
      describe(h + first * element_size), wrong, count));
}

// One step of `variant` on the device and on the host sample, then the comparison.
Status CheckStep(Device& dev, Stream& stream, const DeviceShard& shard,
                 const std::vector<Range>& ranges, HostSample& host, char* sample,
                 const optim::AdamHyper& hyper, bool with_out16, std::string_view variant,
                 const optim::CpuAdamOptions& cpu_scalar) {
  const optim::AdamShard device_shard{shard.master,
                                      shard.grad,
                                      shard.m,
                                      shard.v,
                                      shard.n,
                                      with_out16 ? shard.out16 : nullptr,
                                      device::DType::kBF16};
  STRATA_RETURN_IF_ERROR(optim::DeviceAdamStep(dev, stream, hyper, device_shard, cpu_scalar));
  STRATA_RETURN_IF_ERROR(dev.Synchronize(stream));
  const uint64_t count = host.master.size();
  STRATA_RETURN_IF_ERROR(DownloadSample(dev, stream, shard, ranges, with_out16, sample));
  STRATA_RETURN_IF_ERROR(optim::CpuAdamStep(hyper, host.Shard(with_out16), cpu_scalar));
  const char* p = sample;
  STRATA_RETURN_IF_ERROR(CompareBits(variant, "master", p, host.master.data(), count, 4, ranges));
  p += count * 4;
  STRATA_RETURN_IF_ERROR(CompareBits(variant, "m", p, host.m.data(), count, 4, ranges));
  p += count * 4;
  STRATA_RETURN_IF_ERROR(CompareBits(variant, "v", p, host.v.data(), count, 4, ranges));
  p += count * 4;
  if (with_out16) {
    STRATA_RETURN_IF_ERROR(CompareBits(variant, "out16", p, host.out16.data(), count, 2, ranges));
  }
  return Status::Ok();
}

struct AdamVariant {
  std::string name;
  bool with_out16;
  double bytes_per_param;
};

Status RunAdam(const CommonArgs& common, const AdamArgs& args) {
  STRATA_RETURN_IF_ERROR(CheckCommon(common));
  STRATA_RETURN_IF_ERROR(CheckAdamArgs(args));
  const auto n = static_cast<uint64_t>(args.params);

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, OpenDevice(common));
  const std::string label = DeviceLabel(*dev, common.ordinal);
  const bool on_cpu = dev->type() == device::DeviceType::kCpu;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, dev->CreateStream("optim"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> done0, dev->CreateEvent());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<device::Event> done1, dev->CreateEvent());

  // Device memory first: the budget refuses an oversized run before the pool is faulted in.
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer master, DeviceBuffer::Allocate(*dev, n * 4, "master"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grad, DeviceBuffer::Allocate(*dev, n * 4, "grad"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer m, DeviceBuffer::Allocate(*dev, n * 4, "m"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer v, DeviceBuffer::Allocate(*dev, n * 4, "v"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer out16, DeviceBuffer::Allocate(*dev, n * 2, "the bf16 copy"));
  // Pinned memory: two staging blocks for the upload, one block for the checked elements.
  const std::vector<Range> ranges = CheckRanges(n);
  uint64_t count = 0;
  for (const Range& r : ranges)
    count += r.end - r.begin;
  const uint64_t stage_elements = std::min<uint64_t>(n, uint64_t{8} << 20);  // 32 MiB of fp32
  const uint64_t sample_bytes = count * (3 * 4 + 2);
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<PinnedPool> pool,
      CreatePool(*dev, PoolBytesFor({stage_elements * 4, stage_elements * 4, sample_bytes})));
  STRATA_ASSIGN_OR_RETURN(PoolBlock stage0,
                          PoolBlock::Allocate(*pool, stage_elements * 4, "upload staging"));
  STRATA_ASSIGN_OR_RETURN(PoolBlock stage1,
                          PoolBlock::Allocate(*pool, stage_elements * 4, "upload staging"));
  STRATA_ASSIGN_OR_RETURN(PoolBlock sample,
                          PoolBlock::Allocate(*pool, sample_bytes, "the checked elements"));

  const StreamDrain drain(*dev, {stream.get()});
  const DeviceShard shard{
      reinterpret_cast<float*>(master.data()),   reinterpret_cast<float*>(grad.data()),
      reinterpret_cast<float*>(m.data()),        reinterpret_cast<float*>(v.data()),
      reinterpret_cast<uint16_t*>(out16.data()), n};

  // Known inputs on the device.
  char* const stage[2] = {stage0.data(), stage1.data()};
  device::Event* const uploaded_from[2] = {done0.get(), done1.get()};
  const std::pair<AdamArray, float*> arrays[] = {
      {kMaster, shard.master}, {kGrad, shard.grad}, {kM, shard.m}, {kV, shard.v}};
  for (const auto& [array, dst] : arrays) {
    Status uploaded =
        UploadInitial(*dev, *stream, stage, uploaded_from, stage_elements, array, dst, n);
    if (!uploaded.ok()) {
      return uploaded.WithContext(fmt::format("uploading {}", kAdamArrayNames[array]));
    }
  }
  STRATA_RETURN_IF_ERROR(dev->Fill(shard.out16, device::DType::kBF16, 0.0f, n, *stream));
  STRATA_RETURN_IF_ERROR(dev->Synchronize(*stream));

  // The check: step 1 without the 16-bit copy, step 2 with it, each against the scalar CPU path
  // on host copies of the same inputs (which step 1's check proved equal for step 2).
  const optim::CpuAdamOptions cpu_scalar{optim::Isa::kScalar, args.cpu_threads};
  optim::AdamHyper hyper = PeerHyper();
  HostSample host = InitialSample(ranges);
  // A mismatch (DataLoss-like Internal) does not stop the timing: the numbers of a GPU that is
  // only lent for minutes are worth having even when the kernel's bits are wrong. The program
  // still fails at the end. Any other error (a CUDA failure) stops at once.
  hyper.step = 1;
  Status checked = CheckStep(*dev, *stream, shard, ranges, host, sample.data(), hyper,
                             /*with_out16=*/false, "fp32, step 1", cpu_scalar);
  if (checked.ok()) {
    hyper.step = 2;
    checked = CheckStep(*dev, *stream, shard, ranges, host, sample.data(), hyper,
                        /*with_out16=*/true, "fp32+bf16, step 2", cpu_scalar);
  }
  if (!checked.ok() && checked.code() != StatusCode::kInternal) return checked;
  if (!checked.ok()) {
    fmt::print(stderr, "strata_gpu_bench adam: CHECK FAILED (timing anyway): {}\n",
               checked.ToString());
  }
  int64_t next_step = 3;

  // Timing. On the CPU device the step runs CpuAdamStep at the best ISA (the check used scalar).
  const optim::CpuAdamOptions cpu_timed{optim::BestIsa(), args.cpu_threads};
  const std::vector<AdamVariant> variants = {{"fp32", false, 28.0}, {"fp32+bf16", true, 30.0}};
  Say(common.json_output,
      "strata_gpu_bench adam: device {}, {} fp32 params, AdamW lr 1e-3 betas 0.9/0.999 eps "
      "1e-8 weight_decay 0.01, median of {} batches of {} steps after {} warm-up batches{}\n",
      Described(*dev, label), n, common.reps, args.batch, common.warmup,
      on_cpu ? fmt::format(" (CPU device: ISA {}, {} thread(s))", optim::IsaName(cpu_timed.isa),
                           args.cpu_threads)
             : "");
  std::vector<std::vector<double>> per_step(variants.size());
  for (int round = 0; round < common.warmup + common.reps; ++round) {
    for (size_t j = 0; j < variants.size(); ++j) {
      const size_t k = (j + static_cast<size_t>(round)) % variants.size();
      const optim::AdamShard step_shard{shard.master,
                                        shard.grad,
                                        shard.m,
                                        shard.v,
                                        n,
                                        variants[k].with_out16 ? shard.out16 : nullptr,
                                        device::DType::kBF16};
      const double t0 = NowSeconds();
      for (int b = 0; b < args.batch; ++b) {
        hyper.step = next_step++;
        Status stepped = optim::DeviceAdamStep(*dev, *stream, hyper, step_shard, cpu_timed);
        if (!stepped.ok()) return stepped.WithContext(fmt::format("variant {}", variants[k].name));
      }
      Status synced = dev->Synchronize(*stream);
      if (!synced.ok()) return synced.WithContext(fmt::format("variant {}", variants[k].name));
      const double seconds = (NowSeconds() - t0) / args.batch;
      if (round >= common.warmup) per_step[k].push_back(seconds);
    }
  }

  json out = json::object();
  Say(common.json_output, "{:<11}{:>11}{:>11}{:>10}{:>9}\n", "variant", "median ms", "min ms",
      "GB/s", "B/param");
  for (size_t k = 0; k < variants.size(); ++k) {
    const double median = Median(per_step[k]);
    const double gb = variants[k].bytes_per_param * static_cast<double>(n) / median / 1e9;
    out[variants[k].name] = {{"median_ms", median * 1e3},
                             {"min_ms", Min(per_step[k]) * 1e3},
                             {"gb_per_s", gb},
                             {"bytes_per_param", variants[k].bytes_per_param}};
    Say(common.json_output, "{:<11}{:>11.4f}{:>11.4f}{:>10.1f}{:>9.0f}\n", variants[k].name,
        median * 1e3, Min(per_step[k]) * 1e3, gb, variants[k].bytes_per_param);
  }
  const std::string check_text =
      checked.ok() ? "bit-identical to the CPU scalar path" : "FAILED: " + checked.ToString();
  if (checked.ok()) {
    Say(common.json_output,
        "check: {} elements ({}) after one fp32 and one fp32+bf16 step are bit-identical to the "
        "CPU scalar path\n",
        count, ranges.size() == 1 ? "all" : "head, middle and tail");
  }

  if (common.json_output) {
    json doc = {{"bench", "adam"},
                {"impl", "strata"},
                {"device", label},
                {"strata_device", std::string(dev->name())},
                {"params", n},
                {"reps", common.reps},
                {"warmup", common.warmup},
                {"batch", args.batch},
                {"hyper",
                 {{"lr", 1e-3},
                  {"betas", {0.9, 0.999}},
                  {"eps", 1e-8},
                  {"weight_decay", 0.01},
                  {"adamw", true}}},
                {"variants", out},
                {"check", check_text},
                {"checked_elements", count}};
    if (on_cpu) doc["cpu_isa"] = optim::IsaName(cpu_timed.isa);
    fmt::print("{}\n", doc.dump());
  }
  return checked;
}

// ---- attention ---------------------------------------------------------------------------------

Status RunAttention(const CommonArgs& common, const AttentionArgs& args) {
  STRATA_RETURN_IF_ERROR(CheckCommon(common));
  STRATA_RETURN_IF_ERROR(CheckAttentionArgs(args));
  const device::DType dtype = args.dtype == "fp32"   ? device::DType::kF32
                              : args.dtype == "fp16" ? device::DType::kF16
                                                     : device::DType::kBF16;
  const device::DType act = args.activations == "fp32" ? device::DType::kF32 : dtype;
  const size_t act_size = device::DTypeSize(act);
  const auto b = static_cast<size_t>(args.batch), sq = static_cast<size_t>(args.seq);
  const auto h = static_cast<size_t>(args.heads), kvh = static_cast<size_t>(args.kv_heads);
  const auto d = static_cast<size_t>(args.head_dim);
  const size_t q_n = b * sq * h * d, kv_n = b * sq * kvh * d, lse_n = b * h * sq;

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> dev, OpenDevice(common));
  const std::string label = DeviceLabel(*dev, common.ordinal);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, dev->CreateStream("attention"));
  model::LlamaOpsShape shape;
  shape.batch = b;
  shape.seq = sq;
  shape.hidden = h * d;
  shape.kv_dim = kvh * d;
  shape.num_heads = h;
  shape.head_dim = d;
  std::unique_ptr<model::LlamaOps> ops;
  if (dev->type() == device::DeviceType::kCpu) {
    if (act != device::DType::kF32) {
      return InvalidArgumentError(fmt::format(
          "--activations {}: the CPU device's ops take fp32 activations only", args.activations));
    }
    ops = model::CreateCpuLlamaOps();  // runs on this thread
  } else {
    STRATA_ASSIGN_OR_RETURN(ops, model::CreateCudaLlamaOps(*dev, *stream, shape));
  }

  struct Tensor {
    const char* name;
    size_t count;
  };
  const Tensor tensors[] = {{"q", q_n},   {"k", kv_n},    {"v", kv_n},   {"dout", q_n},
                            {"out", q_n}, {"lse", lse_n}, {"dq", q_n},   {"dk", kv_n},
                            {"dv", kv_n}};
  std::vector<DeviceBuffer> buffers;
  for (const Tensor& t : tensors) {
    const size_t width = std::string_view(t.name) == "lse" ? 4 : act_size;  // lse stays fp32
    STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                            DeviceBuffer::Allocate(*dev, t.count * width, t.name));
    buffers.push_back(std::move(buffer));
  }
  auto at = [&](int i) { return buffers[static_cast<size_t>(i)].data(); };
  const model::Act q(at(0), act), k(at(1), act), v(at(2), act), dout(at(3), act), out(at(4), act),
      dq(at(6), act), dk(at(7), act), dv(at(8), act);
  auto* lse = reinterpret_cast<float*>(at(5));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool, CreatePool(*dev, PoolBytesFor({q_n * 4})));
  STRATA_ASSIGN_OR_RETURN(PoolBlock stage, PoolBlock::Allocate(*pool, q_n * 4, "staging"));
  const StreamDrain drain(*dev, {stream.get()});

  // Inputs uniform in [-1, 1), from the element's index (rounded to 16-bit activations).
  auto* host = reinterpret_cast<float*>(stage.data());
  std::vector<float> values;
  for (int i = 0; i < 4; ++i) {
    const size_t n = tensors[i].count;
    values.resize(n);
    for (size_t j = 0; j < n; ++j) {
      const uint64_t bits = Mix((static_cast<uint64_t>(i) << 40) + j) >> 40;  // 24 bits
      values[j] = static_cast<float>(bits) / static_cast<float>(1u << 23) - 1.0f;
    }
    device::ConvertHost(values.data(), device::DType::kF32, host, act, n);
    STRATA_RETURN_IF_ERROR(
        dev->CopyAsync(at(i), host, n * act_size, CopyKind::kHostToDevice, *stream));
    STRATA_RETURN_IF_ERROR(dev->Synchronize(*stream));  // the staging block is reused
  }

  // Which attention runs (cuDNN's, the tiled kernels, the exact ones), its set-up done here.
  const std::string backend = ops->PrepareAttention(b, sq, h, kvh, d, dtype);
  auto forward = [&]() {
    return ops->AttentionForward(q, k, v, b, sq, h, kvh, d, out, lse, dtype, nullptr);
  };
  auto forward_backward = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(forward());
    return ops->AttentionBackward(q, k, v, out, lse, dout, b, sq, h, kvh, d, dq, dk, dv, dtype,
                                  nullptr);
  };
  auto timed = [&](auto&& enqueue) -> Result<std::vector<double>> {
    std::vector<double> per;
    for (int r = 0; r < common.warmup + common.reps; ++r) {
      const double t0 = NowSeconds();
      STRATA_RETURN_IF_ERROR(enqueue());
      STRATA_RETURN_IF_ERROR(dev->Synchronize(*stream));
      if (r >= common.warmup) per.push_back(NowSeconds() - t0);
    }
    return per;
  };
  STRATA_ASSIGN_OR_RETURN(const std::vector<double> fwd, timed(forward));
  STRATA_ASSIGN_OR_RETURN(const std::vector<double> fwd_bwd, timed(forward_backward));
  STRATA_RETURN_IF_ERROR(ops->CheckDataErrors());

  // The output and dq of the last run must be finite.
  for (const auto& [name, ptr] : {std::pair<const char*, model::Act>{"out", out}, {"dq", dq}}) {
    STRATA_RETURN_IF_ERROR(
        dev->CopyAsync(host, ptr.data, q_n * act_size, CopyKind::kDeviceToHost, *stream));
    STRATA_RETURN_IF_ERROR(dev->Synchronize(*stream));
    values.resize(q_n);
    device::ConvertHost(host, act, values.data(), device::DType::kF32, q_n);
    for (size_t j = 0; j < q_n; ++j) {
      if (!std::isfinite(values[j])) {
        return InternalError(fmt::format("attention check: {}[{}] is {}", name, j, values[j]));
      }
    }
  }

  const double flops = 4.0 * static_cast<double>(b * h * d) *
                       (static_cast<double>(sq) * static_cast<double>(sq + 1) / 2.0);
  const double f_ms = Median(fwd) * 1e3, fb_ms = Median(fwd_bwd) * 1e3;
  const double f_tf = flops / (f_ms * 1e-3) / 1e12, fb_tf = 3.5 * flops / (fb_ms * 1e-3) / 1e12;
  Say(common.json_output,
      "strata_gpu_bench attention: device {}, {} precision, {} activations, batch {}, seq {}, "
      "heads {}/{}, head_dim {}; attention: {}; median of {} after {} warm-up\n",
      Described(*dev, label), args.dtype, args.activations, b, sq, h, kvh, d, backend, common.reps,
      common.warmup);
  Say(common.json_output, "{:<18}{:>11}{:>11}{:>10}\n", "pass", "median ms", "min ms", "TFLOP/s");
  Say(common.json_output, "{:<18}{:>11.3f}{:>11.3f}{:>10.1f}\n", "forward", f_ms, Min(fwd) * 1e3,
      f_tf);
  Say(common.json_output, "{:<18}{:>11.3f}{:>11.3f}{:>10.1f}\n", "forward+backward", fb_ms,
      Min(fwd_bwd) * 1e3, fb_tf);
  if (common.json_output) {
    const json doc = {
        {"bench", "attention"},
        {"impl", "strata"},
        {"backend", backend},
        {"device", label},
        {"shape", {{"batch", b}, {"seq", sq}, {"heads", h}, {"kv_heads", kvh}, {"head_dim", d}}},
        {"dtype", args.dtype},
        {"activations", args.activations},
        {"reps", common.reps},
        {"warmup", common.warmup},
        {"forward_flops", flops},
        {"results",
         {{"forward", {{"median_ms", f_ms}, {"min_ms", Min(fwd) * 1e3}, {"tflops", f_tf}}},
          {"forward_backward",
           {{"median_ms", fb_ms}, {"min_ms", Min(fwd_bwd) * 1e3}, {"tflops", fb_tf}}}}}};
    fmt::print("{}\n", doc.dump());
  }
  return Status::Ok();
}

// ---- command line ------------------------------------------------------------------------------

void AddCommonOptions(CLI::App& cmd, CommonArgs& a) {
  cmd.add_option("--device", a.device, "Device: cuda or cpu (the CPU device, for tests)")
      ->check(CLI::IsMember({"cuda", "cpu"}))
      ->capture_default_str();
  cmd.add_option("--ordinal", a.ordinal, "GPU index (cuda)")->capture_default_str();
  cmd.add_option("--reps", a.reps, "Timed measurements (the median is reported)")
      ->capture_default_str();
  cmd.add_option("--warmup", a.warmup, "Untimed measurements before them")->capture_default_str();
  cmd.add_flag("--json", a.json_output,
               "Print one JSON document on stdout (the table goes to stderr)");
}

}  // namespace
}  // namespace strata::bench

int main(int argc, char** argv) {
  using strata::bench::AdamArgs;
  using strata::bench::AttentionArgs;
  using strata::bench::CommonArgs;
  using strata::bench::CopyArgs;
  CommonArgs common;
  CopyArgs copy;
  AdamArgs adam;
  AttentionArgs attention;
  CLI::App app{
      "GPU micro-benchmarks without a training path: host<->device copies through the pinned "
      "pool, the fused AdamW step on the device, and the decoder's attention. "
      "benchmarks/gpu_peers.py measures the same through PyTorch"};
  app.require_subcommand(1);

  CLI::App* copy_cmd = app.add_subcommand(
      "copy", "Host<->device bandwidth: h2d, d2h and both at once, through the pinned pool");
  strata::bench::AddCommonOptions(*copy_cmd, common);
  copy_cmd->add_option("--bytes", copy.bytes_text, "Bytes moved per measurement (e.g. 1GiB)")
      ->capture_default_str();
  copy_cmd->add_option("--chunk", copy.chunk_text, "Bytes per CopyAsync call (e.g. 64MiB)")
      ->capture_default_str();
  copy_cmd->add_option("--modes", copy.modes, "Comma-separated modes: h2d, d2h, both")
      ->delimiter(',')
      ->check(CLI::IsMember({"h2d", "d2h", "both"}))
      ->capture_default_str();

  CLI::App* adam_cmd =
      app.add_subcommand("adam", "The fused AdamW step on the device, fp32 and fp32 + bf16 copy");
  strata::bench::AddCommonOptions(*adam_cmd, common);
  adam_cmd->add_option("--params", adam.params, "fp32 parameters in the shard")
      ->capture_default_str();
  adam_cmd->add_option("--batch", adam.batch, "Steps per timed measurement")->capture_default_str();
  adam_cmd
      ->add_option("--cpu-threads", adam.cpu_threads,
                   "Threads of each step on the CPU device (ignored on cuda)")
      ->capture_default_str();

  CLI::App* attention_cmd = app.add_subcommand(
      "attention", "The decoder's causal grouped-query attention, forward and backward");
  strata::bench::AddCommonOptions(*attention_cmd, common);
  attention_cmd->add_option("--batch", attention.batch, "Sequences")->capture_default_str();
  attention_cmd->add_option("--seq", attention.seq, "Tokens per sequence")->capture_default_str();
  attention_cmd->add_option("--heads", attention.heads, "Query heads")->capture_default_str();
  attention_cmd->add_option("--kv-heads", attention.kv_heads, "Key/value heads")
      ->capture_default_str();
  attention_cmd->add_option("--head-dim", attention.head_dim, "head_dim")->capture_default_str();
  attention_cmd
      ->add_option("--dtype", attention.dtype,
                   "Precision: bf16 or fp16 (tensor cores, head_dim 64 or 128), fp32 (exact)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  attention_cmd
      ->add_option("--activations", attention.activations,
                   "Activations' dtype: fp32, or --dtype's 16-bit dtype (as the model's with "
                   "16-bit activations; CUDA only)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 1;  // --help exits 0; every usage error exits 1
  }
  const char* name = copy_cmd->parsed() ? "copy" : adam_cmd->parsed() ? "adam" : "attention";
  const strata::Status status = copy_cmd->parsed() ? strata::bench::RunCopy(common, copy)
                                : adam_cmd->parsed()
                                    ? strata::bench::RunAdam(common, adam)
                                    : strata::bench::RunAttention(common, attention);
  if (!status.ok()) {
    std::fprintf(stderr, "strata_gpu_bench %s: %s\n", name, status.ToString().c_str());
    return 1;
  }
  return 0;
}
