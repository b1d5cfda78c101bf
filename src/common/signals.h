// Stop requests by signal: SIGINT (Ctrl-C) and SIGTERM (what Slurm, Kubernetes and mpirun send
// before they kill a job).
//
// InstallStopHandlers makes the first such signal a request: StopSignal() returns its number from
// then on, and one line on stderr says what will happen ("finishing the current step; again to
// stop at once"). The program polls StopSignal() at safe points (the trainer: between steps) and
// winds down in order: an optional checkpoint, its swap files removed, an exit status of
// 128 + the signal. A second signal ends the process at once with that status (whatever is half
// written stays in temporary files that the next run replaces).
#pragma once

namespace strata::signals {

// Idempotent. `what_happens`: the rest of the line printed on the first signal, e.g.
// "finishing the current step, then saving a checkpoint" (must outlive the process: a literal).
void InstallStopHandlers(const char* what_happens);

// The first stop signal received (SIGINT, SIGTERM), or 0.
int StopSignal();

// Forgets a received signal (tests).
void ResetStopSignal();

}  // namespace strata::signals
