#include "comm/op.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "device/dtype_convert.h"

namespace strata::comm::internal {

namespace {

bool KnownDType(device::DType dtype) {
  switch (dtype) {
    case device::DType::kF32:
    case device::DType::kBF16:
    case device::DType::kF16:
      return true;
  }
  return false;
}

bool KnownOp(ReduceOp op) {
  return op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kMax;
}

bool Overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto a0 = reinterpret_cast<uintptr_t>(a);
  const auto b0 = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

std::string Hex(const void* ptr) {
  return fmt::format("{:#x}", reinterpret_cast<uintptr_t>(ptr));
}

}  // namespace

std::string_view OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllGather:
      return "all-gather";
    case OpKind::kReduceScatter:
      return "reduce-scatter";
    case OpKind::kAllReduce:
      return "all-reduce";
    case OpKind::kAllToAll:
      return "all-to-all";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
  }
  return "unknown";
}

bool IsEmpty(const OpDesc& desc) {
  return desc.kind != OpKind::kBarrier && desc.count == 0;
}

bool IsInPlace(const OpDesc& desc, int rank) {
  const size_t elem = device::DTypeSize(desc.dtype);
  const auto* send = static_cast<const std::byte*>(desc.send);
  auto* recv = static_cast<std::byte*>(desc.recv);
  switch (desc.kind) {
    case OpKind::kAllGather:
      return send == recv + static_cast<size_t>(rank) * desc.count * elem;
    case OpKind::kReduceScatter:
      return recv == send + static_cast<size_t>(rank) * desc.count * elem;
    case OpKind::kAllReduce:
      return send == recv;
    case OpKind::kAllToAll:
    case OpKind::kBroadcast:
    case OpKind::kBarrier:
      return false;
  }
  return false;
}

Status ValidateOp(std::string_view backend, const OpDesc& desc, int rank, int world) {
  const std::string_view name = OpKindName(desc.kind);
  auto error = [&](std::string_view what) {
    return InvalidArgumentError(fmt::format("{} {}: {}", backend, name, what));
  };
  if (desc.kind == OpKind::kBarrier) return Status::Ok();
  if (desc.kind == OpKind::kBroadcast) {
    if (desc.root < 0 || desc.root >= world) {
      return error(fmt::format("root {} is not a rank of this world (size {})", desc.root, world));
    }
    if (desc.count > 0 && desc.recv == nullptr) {
      return error(fmt::format("buffer is null ({} bytes)", desc.count));
    }
    return Status::Ok();
  }
  if (!KnownDType(desc.dtype)) {
    return error(fmt::format("unknown dtype {}", static_cast<int>(desc.dtype)));
  }
  if ((desc.kind == OpKind::kReduceScatter || desc.kind == OpKind::kAllReduce) &&
      !KnownOp(desc.op)) {
    return error(fmt::format("unknown reduce op {}", static_cast<int>(desc.op)));
  }
  if (desc.count == 0) return Status::Ok();
  const size_t elem = device::DTypeSize(desc.dtype);
  const bool per_rank = desc.kind != OpKind::kAllReduce;
  const size_t max_count = std::numeric_limits<size_t>::max() / elem / (per_rank ? world : 1);
  if (desc.count > max_count) {
    return error(fmt::format("count {} x {} overflows the address space", desc.count,
                             device::DTypeName(desc.dtype)));
  }
  for (auto [ptr, what] : {std::pair<const void*, std::string_view>{desc.send, "send"},
                           std::pair<const void*, std::string_view>{desc.recv, "recv"}}) {
    if (ptr == nullptr) return error(fmt::format("{} buffer is null", what));
    if (reinterpret_cast<uintptr_t>(ptr) % elem != 0) {
      return error(fmt::format("{} buffer {} is not aligned to {} ({} bytes)", what, Hex(ptr),
                               device::DTypeName(desc.dtype), elem));
    }
  }
  const size_t whole = desc.count * elem * (per_rank ? static_cast<size_t>(world) : 1);
  const size_t part = desc.count * elem;
  const size_t send_bytes = desc.kind == OpKind::kAllGather ? part : whole;
  const size_t recv_bytes = desc.kind == OpKind::kReduceScatter ? part : whole;
  if (!IsInPlace(desc, rank) && Overlap(desc.send, send_bytes, desc.recv, recv_bytes)) {
    if (desc.kind == OpKind::kAllToAll) {
      return error(fmt::format(
          "send [{}, +{} B) and recv [{}, +{} B) overlap; they must be disjoint (an all-to-all "
          "has no in-place form)",
          Hex(desc.send), send_bytes, Hex(desc.recv), recv_bytes));
    }
    std::string in_place;
    switch (desc.kind) {
      case OpKind::kAllGather:
        in_place = fmt::format("send == recv + rank * count = {}",
                               Hex(static_cast<const std::byte*>(desc.recv) + rank * part));
        break;
      case OpKind::kReduceScatter:
        in_place = fmt::format("recv == send + rank * count = {}",
                               Hex(static_cast<const std::byte*>(desc.send) + rank * part));
        break;
      default:
        in_place = "send == recv";
        break;
    }
    return error(fmt::format(
        "send [{}, +{} B) and recv [{}, +{} B) overlap; they must be disjoint or in place ({})",
        Hex(desc.send), send_bytes, Hex(desc.recv), recv_bytes, in_place));
  }
  return Status::Ok();
}

std::string DescribeOp(const OpDesc& desc, uint64_t seq) {
  const std::string_view name = OpKindName(desc.kind);
  switch (desc.kind) {
    case OpKind::kAllGather:
      return fmt::format("{} #{} ({} x {} per rank)", name, seq, desc.count,
                         device::DTypeName(desc.dtype));
    case OpKind::kReduceScatter:
      return fmt::format("{} #{} ({} x {} per rank, {})", name, seq, desc.count,
                         device::DTypeName(desc.dtype), ReduceOpName(desc.op));
    case OpKind::kAllReduce:
      return fmt::format("{} #{} ({} x {}, {})", name, seq, desc.count,
                         device::DTypeName(desc.dtype), ReduceOpName(desc.op));
    case OpKind::kAllToAll:
      return fmt::format("{} #{} ({} x {} per rank)", name, seq, desc.count,
                         device::DTypeName(desc.dtype));
    case OpKind::kBroadcast:
      return fmt::format("{} #{} ({} B from rank {})", name, seq, desc.count, desc.root);
    case OpKind::kBarrier:
      return fmt::format("{} #{}", name, seq);
  }
  return fmt::format("{} #{}", name, seq);
}

std::string TraceName(const OpDesc& desc) {
  if (desc.kind == OpKind::kBroadcast || desc.kind == OpKind::kBarrier) {
    return std::string(OpKindName(desc.kind));
  }
  return fmt::format("{} {}", OpKindName(desc.kind), device::DTypeName(desc.dtype));
}

uint64_t OpBytes(const OpDesc& desc, int world) {
  switch (desc.kind) {
    case OpKind::kAllGather:
    case OpKind::kReduceScatter:
    case OpKind::kAllToAll:
      return uint64_t{desc.count} * device::DTypeSize(desc.dtype) * static_cast<uint64_t>(world);
    case OpKind::kAllReduce:
      return uint64_t{desc.count} * device::DTypeSize(desc.dtype);
    case OpKind::kBroadcast:
      return desc.count;
    case OpKind::kBarrier:
      return 0;
  }
  return 0;
}

void WidenToF32(const void* src, device::DType dtype, float* dst, size_t n) {
  switch (dtype) {
    case device::DType::kF32:
      if (src != dst) std::memmove(dst, src, n * sizeof(float));
      return;
    case device::DType::kBF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i)
        dst[i] = device::convert::Bf16ToFloat(in[i]);
      return;
    }
    case device::DType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i)
        dst[i] = device::convert::F16ToFloat(in[i]);
      return;
    }
  }
}

void NarrowFromF32(const float* src, float scale, void* dst, device::DType dtype, size_t n) {
  switch (dtype) {
    case device::DType::kF32: {
      auto* out = static_cast<float*>(dst);
      if (scale == 1.0f) {
        if (static_cast<const void*>(src) != dst) std::memmove(out, src, n * sizeof(float));
        return;
      }
      for (size_t i = 0; i < n; ++i)
        out[i] = src[i] * scale;
      return;
    }
    case device::DType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i)
        out[i] = device::convert::FloatToBf16(src[i] * scale);
      return;
    }
    case device::DType::kF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i)
        out[i] = device::convert::FloatToF16(src[i] * scale);
      return;
    }
  }
}

void ReduceInRankOrder(const std::byte* const* src, size_t world, device::DType dtype,
                       ReduceOp op, std::byte* out, size_t n) {
  const float scale = op == ReduceOp::kAvg ? AvgScale(static_cast<int>(world)) : 1.0f;
  constexpr size_t kBlock = 2048;
  const size_t elem = device::DTypeSize(dtype);
  alignas(64) float acc[kBlock];
  alignas(64) float wide[kBlock];
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t len = std::min(kBlock, n - at);
    WidenToF32(src[0] + at * elem, dtype, acc, len);
    for (size_t q = 1; q < world; ++q) {
      const float* add = wide;
      if (dtype == device::DType::kF32) {
        add = reinterpret_cast<const float*>(src[q]) + at;
      } else {
        WidenToF32(src[q] + at * elem, dtype, wide, len);
      }
      if (op == ReduceOp::kMax) {
        // A NaN anywhere wins (a comparison with NaN is false, so acc keeps one once it has it).
        for (size_t i = 0; i < len; ++i) {
          if (add[i] > acc[i] || std::isnan(add[i])) acc[i] = add[i];
        }
      } else {
        for (size_t i = 0; i < len; ++i)
          acc[i] += add[i];
      }
    }
    NarrowFromF32(acc, scale, out + at * elem, dtype, len);
  }
}

Status ValidateSplit(std::string_view backend, int color) {
  if (color < 0) {
    return InvalidArgumentError(
        fmt::format("{} split: the color must be >= 0, got {}", backend, color));
  }
  return Status::Ok();
}

SplitPlace PlaceInSplit(const std::vector<std::pair<int, int>>& color_key, int rank) {
  SplitPlace place;
  const int color = color_key[static_cast<size_t>(rank)].first;
  for (int q = 0; q < static_cast<int>(color_key.size()); ++q) {
    if (color_key[static_cast<size_t>(q)].first == color) place.members.push_back(q);
  }
  std::stable_sort(place.members.begin(), place.members.end(), [&](int a, int b) {
    return color_key[static_cast<size_t>(a)].second < color_key[static_cast<size_t>(b)].second;
  });
  place.rank = static_cast<int>(std::find(place.members.begin(), place.members.end(), rank) -
                                place.members.begin());
  return place;
}

}  // namespace strata::comm::internal
