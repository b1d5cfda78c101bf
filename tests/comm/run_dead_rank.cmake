# Runs strata_comm_dead_rank under mpirun and checks what the ranks and mpirun printed.
#   cmake -DMPIEXEC=... -DNP=2 -DMODE=kill|exit|leave|mismatch -DLAUNCHER_MODE=recovery|default|mismatch
#         -DPROGRAM=... -DTIMEOUT_MS=3000 -P run_dead_rank.cmake
# recovery: mpirun --enable-recovery keeps the survivors alive; each of the NP - 1 survivors
#           must print "survivor OK" (the program checks its own error: code, the dead rank,
#           the operation and its sequence number, the time it took, a later op failing at once).
# default:  mpirun tears the job down itself; its own message must appear, and it must be quick.
# mismatch: (with MODE mismatch) every rank must print "mismatch OK", one at least with
#           InvalidArgument.
# Either way the whole run must end well within the ctest timeout.
foreach(var MPIEXEC NP MODE LAUNCHER_MODE PROGRAM TIMEOUT_MS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_dead_rank.cmake: -D${var}=... is required")
  endif()
endforeach()

set(launcher_args --oversubscribe --bind-to none)
if(LAUNCHER_MODE STREQUAL "recovery" OR LAUNCHER_MODE STREQUAL "mismatch")
  list(APPEND launcher_args --enable-recovery)
endif()

string(TIMESTAMP start "%s")
execute_process(
  COMMAND ${MPIEXEC} -n ${NP} ${launcher_args} ${PROGRAM} --timeout-ms ${TIMEOUT_MS} --mode ${MODE}
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc
  TIMEOUT 90)
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
message("---- mpirun exited with '${rc}' after about ${elapsed} s; its output:\n${out}${err}----")

set(all "${out}${err}")
if(rc MATCHES "timeout")
  message(FATAL_ERROR "the job did not end within 90 s")
endif()
if(elapsed GREATER 60)
  message(FATAL_ERROR "the job took ${elapsed} s; expected well under a minute")
endif()

if(LAUNCHER_MODE STREQUAL "mismatch")
  # Every rank fails; at least one with its own InvalidArgument (the others may hear of it first).
  string(REGEX MATCHALL "mismatch OK" oks "${all}")
  list(LENGTH oks ok_count)
  if(all MATCHES "mismatch BAD" OR NOT ok_count EQUAL NP)
    message(FATAL_ERROR "${ok_count} of ${NP} ranks reported a correct error")
  endif()
  if(NOT all MATCHES "mismatch OK: INVALID_ARGUMENT")
    message(FATAL_ERROR "no rank reported the size mismatch itself (InvalidArgument)")
  endif()
elseif(LAUNCHER_MODE STREQUAL "recovery")
  string(REGEX MATCHALL "survivor OK" oks "${all}")
  list(LENGTH oks ok_count)
  math(EXPR expected "${NP} - 1")
  if(all MATCHES "survivor BAD")
    message(FATAL_ERROR "a survivor's error did not meet the contract (see 'survivor BAD' above)")
  endif()
  if(NOT ok_count EQUAL expected)
    message(FATAL_ERROR "${ok_count} of ${expected} survivors reported a correct error")
  endif()
else()
  set(launcher_message
      "(mpirun|mpiexec) noticed that process rank 1|(mpirun|mpiexec) detected that one or more")
  if(NOT all MATCHES "${launcher_message}")
    message(FATAL_ERROR "mpirun's own message about the dead rank is missing")
  endif()
  if(rc EQUAL 0)
    message(FATAL_ERROR "mpirun exited 0 although a rank died")
  endif()
endif()
