#include "strata/version.h"

#include <string_view>

#include "common/build_info.h"

namespace strata {

namespace {
bool CMakeTrue(std::string_view v) { return v == "ON" || v == "TRUE" || v == "1" || v == "YES"; }
}  // namespace

std::string_view Version() { return STRATA_VERSION_STRING; }

const BuildInfo& GetBuildInfo() {
  static const BuildInfo info = [] {
    BuildInfo b;
    b.version = STRATA_VERSION_STRING;
    b.build_type = STRATA_BUILD_TYPE;
    b.cxx_compiler = STRATA_CXX_COMPILER;
    b.with_cuda = CMakeTrue(STRATA_BUILT_WITH_CUDA_STR);
    b.cuda_compiler = b.with_cuda ? STRATA_CUDA_COMPILER : "";
    b.with_nccl = CMakeTrue(STRATA_BUILT_WITH_NCCL_STR);
    b.with_mpi = CMakeTrue(STRATA_BUILT_WITH_MPI_STR);
    b.sanitizers = STRATA_SANITIZE_STR;
    return b;
  }();
  return info;
}

}  // namespace strata
