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

# --- cuDNN frontend headers (optional, only with CUDA) ---------------------------------------------
# Header-only; deploy/cudnn-frontend.sh puts the pinned release in the cache directory below.
# cuDNN itself is loaded at run time (src/model/cudnn_loader.h), so only its headers are needed
# here, and those come with the CUDA toolkit.
set(STRATA_HAVE_CUDNN_FRONTEND OFF)
if(STRATA_HAVE_CUDA)
  if(DEFINED ENV{STRATA_CACHE_DIR})
    set(_strata_cache "$ENV{STRATA_CACHE_DIR}")
  elseif(DEFINED ENV{XDG_CACHE_HOME})
    set(_strata_cache "$ENV{XDG_CACHE_HOME}/strata")
  else()
    set(_strata_cache "$ENV{HOME}/.cache/strata")
  endif()
  set(STRATA_CUDNN_FRONTEND_DIR "${_strata_cache}/cudnn-frontend-1.32.0/include" CACHE PATH
      "The cuDNN frontend's include directory (deploy/cudnn-frontend.sh fetches it)")
  find_path(STRATA_CUDNN_HEADER cudnn.h HINTS ${CUDAToolkit_INCLUDE_DIRS} NO_CACHE)
  if(EXISTS "${STRATA_CUDNN_FRONTEND_DIR}/cudnn_frontend.h" AND STRATA_CUDNN_HEADER)
    set(STRATA_HAVE_CUDNN_FRONTEND ON)
  elseif(NOT STRATA_CUDNN_HEADER)
    message(STATUS "cuDNN attention: off (no cudnn.h with the CUDA toolkit)")
  else()
    message(STATUS "cuDNN attention: off (no cudnn_frontend.h in ${STRATA_CUDNN_FRONTEND_DIR}: "
                   "run deploy/cudnn-frontend.sh and configure again)")
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
