// StripeLayout: where the bytes of a logical file striped over N paths live.
//
// Bytes [k*unit, (k+1)*unit) of the logical file are in path k % N at offset (k / N) * unit, as
// in RAID-0. With one path the layout is the identity. Pure arithmetic; no I/O.
#pragma once

#include <cstdint>
#include <vector>

namespace strata::io {

struct StripeSegment {
  uint32_t path_index = 0;   // which path
  uint64_t path_offset = 0;  // byte offset within that path's file
  uint64_t length = 0;
  uint64_t buffer_offset = 0;  // offset of this piece within the request's buffer
};

class StripeLayout {
 public:
  // `num_paths` >= 1; `stripe_unit` > 0 (ignored when num_paths == 1).
  StripeLayout(uint32_t num_paths, uint64_t stripe_unit);

  uint32_t num_paths() const { return num_paths_; }
  uint64_t stripe_unit() const { return unit_; }

  // Appends the pieces of logical range [offset, offset + length) to `out`, in logical order.
  void Map(uint64_t offset, uint64_t length, std::vector<StripeSegment>* out) const;

  // Bytes path `index` holds when the logical file is `logical_size` bytes long.
  uint64_t PathBytes(uint32_t index, uint64_t logical_size) const;

 private:
  uint32_t num_paths_;
  uint64_t unit_;
};

}  // namespace strata::io
