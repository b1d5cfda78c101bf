// Version and build facts of the Strata library in use.
#pragma once

#include <string>
#include <string_view>

namespace strata {

// "0.1.0"
std::string_view Version();

struct BuildInfo {
  std::string version;
  std::string build_type;     // "RelWithDebInfo", ...
  std::string cxx_compiler;   // "GNU 12.2.0"
  std::string cuda_compiler;  // "NVIDIA 13.0.88" or "" without CUDA
  bool with_cuda = false;     // CUDA targets were built
  bool with_nccl = false;
  bool with_mpi = false;
  std::string sanitizers;     // "" or "address,undefined" / "thread"
};
const BuildInfo& GetBuildInfo();

}  // namespace strata
