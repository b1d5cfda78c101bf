# Every library Strata needs comes from Debian packages (deploy/install-deps.sh installs them).
# Required: liburing, hwloc, xxhash, spdlog (+fmt), nlohmann-json, CLI11, Threads.
# Optional, detected: CUDA toolkit, NCCL, MPI. Tests: GoogleTest; benchmarks: Google Benchmark.

find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)

pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing>=2.1)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc>=2.0)
# XXH3 checksums of offloaded shards and checkpoint files.
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash>=0.8)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)

# OpenBLAS (cblas_sgemm) for CPU compute. Debian's libopenblas-dev provides cblas.h and
# libopenblas through the BLAS alternatives; find it directly so the pthread variant is used.
find_path(OPENBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas-pthread openblas)
find_library(OPENBLAS_LIBRARY NAMES openblas PATH_SUFFIXES openblas-pthread)
if(NOT OPENBLAS_INCLUDE_DIR OR NOT OPENBLAS_LIBRARY)
  message(FATAL_ERROR "OpenBLAS not found: install libopenblas-dev (deploy/install-deps.sh)")
endif()
add_library(strata_openblas INTERFACE)
target_include_directories(strata_openblas SYSTEM INTERFACE ${OPENBLAS_INCLUDE_DIR})
target_link_libraries(strata_openblas INTERFACE ${OPENBLAS_LIBRARY})

if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
endif()
if(STRATA_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# --- CUDA (optional) -------------------------------------------------------------------------
set(STRATA_HAVE_CUDA OFF)
if(NOT STRATA_WITH_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND)
      set(STRATA_HAVE_CUDA ON)
    endif()
  endif()
  if(STRATA_WITH_CUDA STREQUAL "ON" AND NOT STRATA_HAVE_CUDA)
    message(FATAL_ERROR "STRATA_WITH_CUDA=ON but no CUDA compiler/toolkit was found")
  endif()
endif()

# --- NCCL (optional, only with CUDA) -----------------------------------------------------------
set(STRATA_HAVE_NCCL OFF)
if(STRATA_HAVE_CUDA)
  get_filename_component(_strata_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_strata_cuda_root}/include)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${_strata_cuda_root}/lib
                                       ${_strata_cuda_root}/lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(STRATA_HAVE_NCCL ON)
    add_library(strata_nccl INTERFACE)
    target_include_directories(strata_nccl SYSTEM INTERFACE ${NCCL_INCLUDE_DIR})
    target_link_libraries(strata_nccl INTERFACE ${NCCL_LIBRARY})
  endif()
endif()

# --- MPI (optional) ----------------------------------------------------------------------------
set(STRATA_HAVE_MPI OFF)
if(NOT STRATA_WITH_MPI STREQUAL "OFF")
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(STRATA_HAVE_MPI ON)
  elseif(STRATA_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "STRATA_WITH_MPI=ON but MPI was not found")
  endif()
endif()
