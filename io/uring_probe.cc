#include "io/uring_probe.h"

#include <liburing.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <string_view>

#include "common/errno.h"
#include "common/proc_files.h"

namespace strata::io {

namespace {

// One setup configuration to try on its own. Some flags need a companion flag to be valid
// (TASKRUN_FLAG needs COOP_TASKRUN, DEFER_TASKRUN needs SINGLE_ISSUER); the companion is set
// too, and the attempt is recorded under the flag's name.
struct SetupProbe {
  const char* name;
  uint32_t flags;
};

constexpr SetupProbe kSetupProbes[] = {
    {"SQPOLL", IORING_SETUP_SQPOLL},
    {"SINGLE_ISSUER", IORING_SETUP_SINGLE_ISSUER},
    {"COOP_TASKRUN", IORING_SETUP_COOP_TASKRUN},
    {"TASKRUN_FLAG", IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG},
    {"DEFER_TASKRUN", IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN},
    {"SUBMIT_ALL", IORING_SETUP_SUBMIT_ALL},
    {"CQSIZE", IORING_SETUP_CQSIZE},
};

// IORING_FEAT_* bits by name. The later ones are newer than liburing 2.3's header; their values
// are kernel ABI.
constexpr const char* kFeatureNames[] = {
    "SINGLE_MMAP", "NODROP",      "SUBMIT_STABLE",   "RW_CUR_POS",   "CUR_PERSONALITY",
    "FAST_POLL",   "POLL_32BITS", "SQPOLL_NONFIXED", "EXT_ARG",      "NATIVE_WORKERS",
    "RSRC_TAGS",   "CQE_SKIP",    "LINKED_FILE",     "REG_REG_RING", "RECVSEND_BUNDLE",
    "MIN_TIMEOUT", "RW_ATTR",     "NO_IOWAIT",
};
static_assert((1U << 12) == IORING_FEAT_LINKED_FILE, "feature table out of step with liburing");

constexpr unsigned kProbeEntries = 8;

// Creates a ring with `flags`; returns 0 or a negative errno.
int TrySetup(uint32_t flags, io_uring* ring, io_uring_params* params) {
  *params = io_uring_params{};
  params->flags = flags;
  if (flags & IORING_SETUP_SQPOLL) params->sq_thread_idle = 10;  // ms; the thread exits soon
  if (flags & IORING_SETUP_CQSIZE) params->cq_entries = kProbeEntries * 4;
  return io_uring_queue_init_params(kProbeEntries, ring, params);
}

std::string ErrorText(int err, std::string_view context) {
  return std::string(ErrnoToStatus(err, context).message());
}

}  // namespace

UringSupport ProbeUring() {
  UringSupport s;
  if (auto v = procfs::ReadUintFile("/proc/sys/kernel/io_uring_disabled")) {
    s.disabled_sysctl = static_cast<int>(*v);
  }

  io_uring ring{};
  io_uring_params params{};
  int rc = TrySetup(0, &ring, &params);
  if (rc < 0) {
    s.error = ErrorText(-rc, "io_uring_setup");
    if (s.disabled_sysctl == 2) {
      s.error += "; io_uring is disabled by sysctl kernel.io_uring_disabled=2";
    } else if (s.disabled_sysctl == 1) {
      s.error +=
          "; kernel.io_uring_disabled=1 limits io_uring to the group in "
          "kernel.io_uring_group";
    } else if (-rc == EPERM || -rc == ENOSYS) {
      s.error += "; a seccomp profile (container runtime) may block io_uring";
    }
    return s;
  }
  s.available = true;
  for (unsigned bit = 0; bit < 32; ++bit) {
    if ((params.features & (1U << bit)) == 0) continue;
    s.features.push_back(bit < std::size(kFeatureNames) ? kFeatureNames[bit]
                                                        : "bit " + std::to_string(bit));
  }

  // One 64 KiB fixed buffer: charged to RLIMIT_MEMLOCK (unless CAP_IPC_LOCK).
  constexpr size_t kBufferBytes = 64 * 1024;
  void* buffer = std::aligned_alloc(4096, kBufferBytes);
  if (buffer != nullptr) {
    iovec iov{buffer, kBufferBytes};
    if (io_uring_register_buffers(&ring, &iov, 1) == 0) {
      s.register_buffers = true;
      io_uring_unregister_buffers(&ring);
    }
    std::free(buffer);
  }
  if (io_uring_register_files_sparse(&ring, 4) == 0) {
    s.register_files = true;
    io_uring_unregister_files(&ring);
  }
  io_uring_queue_exit(&ring);

  for (const SetupProbe& probe : kSetupProbes) {
    io_uring probe_ring{};
    io_uring_params probe_params{};
    if (TrySetup(probe.flags, &probe_ring, &probe_params) == 0) {
      s.setup_flags_ok.emplace_back(probe.name);
      io_uring_queue_exit(&probe_ring);
    } else {
      s.setup_flags_rejected.emplace_back(probe.name);
    }
  }
  return s;
}

}  // namespace strata::io
