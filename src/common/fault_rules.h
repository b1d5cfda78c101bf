// The bookkeeping the fault injectors share (io/fault_injection.h for I/O, device/fault_device.h
// for the device): their rules in the order added, each with how many calls it considered and
// how many faults it injected.
//
// Threading: not thread-safe; each injector guards its FaultRules with its own mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace strata {

template <typename Rule>
class FaultRules {
 public:
  struct Entry {
    Rule rule;
    uint64_t seen = 0;  // calls the rule considered
    uint64_t hits = 0;  // faults it injected
  };

  // Returns the rule's index (for hits()).
  size_t Add(Rule rule) {
    entries_.push_back(Entry{std::move(rule)});
    return entries_.size() - 1;
  }
  void Clear() { entries_.clear(); }

  uint64_t hits(size_t index) const { return index < entries_.size() ? entries_[index].hits : 0; }
  uint64_t total_hits() const {
    uint64_t total = 0;
    for (const Entry& e : entries_) total += e.hits;
    return total;
  }

  std::vector<Entry>& entries() { return entries_; }

 private:
  std::vector<Entry> entries_;
};

}  // namespace strata
