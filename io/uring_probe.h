// What the kernel's io_uring supports here: used by `strata env`, by the auto backend choice,
// and by tests that skip when a feature is missing.
#pragma once

#include <string>
#include <vector>

namespace strata::io {

struct UringSupport {
  bool available = false;  // a ring could be created
  // Why not, when !available: "io_uring_setup: Operation not permitted (EPERM)" plus a hint
  // (the sysctl, a seccomp profile).
  std::string error;
  int disabled_sysctl = -1;  // /proc/sys/kernel/io_uring_disabled, -1 if absent
  // Setup flags that a ring accepted when tried on their own (by name, e.g. "SINGLE_ISSUER").
  std::vector<std::string> setup_flags_ok;
  std::vector<std::string> setup_flags_rejected;
  std::vector<std::string> features;  // IORING_FEAT_* reported, without the prefix ("NODROP")
  bool register_buffers = false;      // a small buffer could be registered (memlock permitting)
  bool register_files = false;        // sparse registered file table works
};

// Probes by creating small throwaway rings: one plain ring (features, a 64 KiB registered buffer,
// a 4-slot sparse file table), then one ring per setup flag on its own (TASKRUN_FLAG together
// with COOP_TASKRUN, DEFER_TASKRUN with SINGLE_ISSUER, as the kernel requires). Cheap (a few
// syscalls; an SQPOLL ring briefly starts a kernel thread); does not touch any file.
// Thread safety: may be called from any thread; each call uses its own rings.
UringSupport ProbeUring();

}  // namespace strata::io
