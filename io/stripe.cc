#include "io/stripe.h"

#include <algorithm>

namespace strata::io {

StripeLayout::StripeLayout(uint32_t num_paths, uint64_t stripe_unit)
    : num_paths_(num_paths == 0 ? 1 : num_paths), unit_(stripe_unit == 0 ? 1 : stripe_unit) {}

void StripeLayout::Map(uint64_t offset, uint64_t length, std::vector<StripeSegment>* out) const {
  if (length == 0) return;
  if (num_paths_ == 1) {
    out->push_back({0, offset, length, 0});
    return;
  }
  uint64_t done = 0;
  while (done < length) {
    uint64_t pos = offset + done;
    uint64_t stripe = pos / unit_;
    uint64_t within = pos % unit_;
    uint64_t n = std::min(unit_ - within, length - done);
    out->push_back({static_cast<uint32_t>(stripe % num_paths_),
                    (stripe / num_paths_) * unit_ + within, n, done});
    done += n;
  }
}

uint64_t StripeLayout::PathBytes(uint32_t index, uint64_t logical_size) const {
  if (num_paths_ == 1) return logical_size;
  uint64_t full_stripes = logical_size / unit_;
  uint64_t tail = logical_size % unit_;
  // Stripes 0..full_stripes-1 are whole; stripe `full_stripes` holds `tail` bytes.
  uint64_t rounds = full_stripes / num_paths_;
  uint64_t extra = full_stripes % num_paths_;  // paths 0..extra-1 get one more whole stripe
  uint64_t bytes = rounds * unit_ + (index < extra ? unit_ : 0);
  if (index == extra) bytes += tail;
  return bytes;
}

}  // namespace strata::io
