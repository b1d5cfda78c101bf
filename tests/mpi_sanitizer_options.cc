// Linked into the test programs that start MPI. Open MPI does not free everything it allocates
// (its transport components are unloaded at exit, so the leaks cannot even be attributed by
// library name), which would fail every run under LeakSanitizer. These programs therefore run
// without leak detection; the same engine code is leak-checked in the single-rank suites, which
// never start MPI. AddressSanitizer's other checks stay on.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
