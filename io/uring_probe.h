// What the kernel's io_uring supports here: used by `strata env`, by the auto backend choice,
// and by tests that skip when a feature is missing.
#pragma once

#include <string>
#include <vector>

namespace strata::io {

struct UringSupport {
  bool available = false;       // a ring could be created
  std::string error;            // why not, when !available (e.g. "Operation not permitted (EPERM)")
  int disabled_sysctl = -1;     // /proc/sys/kernel/io_uring_disabled, -1 if absent
  // Setup flags that a ring accepted when tried on their own (by name, e.g. "SINGLE_ISSUER").
  std::vector<std::string> setup_flags_ok;
  std::vector<std::string> setup_flags_rejected;
  std::vector<std::string> features;  // IORING_FEAT_* reported by the kernel
  bool register_buffers = false;      // a small buffer could be registered (memlock permitting)
  bool register_files = false;        // sparse registered file table works
};

// Probes by creating small throwaway rings. Cheap (a few syscalls); does not touch any file.
UringSupport ProbeUring();

}  // namespace strata::io
