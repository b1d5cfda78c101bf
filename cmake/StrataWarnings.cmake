# strata_target_defaults(<target>): the warning flags, sanitizers and include layout every Strata
# target shares. Third-party headers are included as SYSTEM so their warnings do not fail -Werror.
add_library(strata_build_flags INTERFACE)
target_compile_options(strata_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wcast-align
                            -Wformat=2 -Wimplicit-fallthrough>
  # clang checks the lock annotations (common/thread_annotations.h); GCC has no such analysis.
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:Clang>>:-Wthread-safety>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${STRATA_WERROR}>>:-Werror>
  $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${STRATA_WERROR}>>:-Werror=all-warnings>)

if(STRATA_SANITIZE)
  set(_san "-fsanitize=${STRATA_SANITIZE}")
  target_compile_options(strata_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:${_san} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
  target_link_options(strata_build_flags INTERFACE ${_san})
endif()

function(strata_target_defaults target)
  target_link_libraries(${target} PRIVATE strata_build_flags)
endfunction()
