// Statistics the standalone benchmark programs share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace strata::bench {

// The median of a non-empty sample (the mean of the middle two for an even count).
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 == 1 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

}  // namespace strata::bench
