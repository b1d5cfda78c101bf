# Compiles SOURCE (tests/common/thread_safety_violations.cc) with clang's thread-safety analysis
# as errors and checks that the compile fails with every diagnostic its `// expect: ...` comments
# name, and with no other. Run by ctest in clang builds:
#   cmake -DCXX=<clang++> -DSOURCE=<file> -DINCLUDE=<src dir> -P check_thread_safety_violations.cmake
execute_process(
  COMMAND ${CXX} -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety -I${INCLUDE} ${SOURCE}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "the thread-safety violations compiled cleanly: the analysis is off")
endif()
file(STRINGS ${SOURCE} lines REGEX "// expect: ")
set(expected 0)
foreach(line IN LISTS lines)
  string(REGEX REPLACE ".*// expect: " "" message "${line}")
  string(FIND "${err}" "${message}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "not reported: '${message}'\ncompiler output:\n${err}")
  endif()
  math(EXPR expected "${expected} + 1")
endforeach()
string(REGEX MATCHALL "-Werror,-Wthread-safety" reported "${err}")
list(LENGTH reported count)
if(NOT count EQUAL expected)
  message(FATAL_ERROR "expected ${expected} thread-safety errors, got ${count}:\n${err}")
endif()
message(STATUS "all ${expected} thread-safety violations reported")
