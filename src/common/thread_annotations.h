// Clang's thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html) as
// macros that vanish on other compilers.
//
// They state, in the declaration, which lock guards which field and which lock a function needs,
// takes or must not hold; clang's -Wthread-safety then checks every access against them at
// compile time (the `thread-safety` preset builds the annotated libraries that way, in CI). GCC
// ignores them: its builds are unchanged.
//
//   GUARDED_BY(mu)      a field read or written only with mu held
//   PT_GUARDED_BY(mu)   the pointee of a pointer field, likewise (the pointer itself is not)
//   REQUIRES(mu)        the caller holds mu (exclusively) on entry and on return
//   EXCLUDES(mu)        the caller does not hold mu (the function takes it)
//   ACQUIRE(mu)         the function takes mu and returns holding it
//   RELEASE(mu)         the function releases mu, which the caller held
//   CAPABILITY(name)    the class is a lock (common/mutex.h Mutex)
//   SCOPED_CAPABILITY   the class holds a lock for its lifetime (MutexLock)
//   RETURN_CAPABILITY(mu)  the function returns a reference to mu (an accessor)
//   ASSERT_CAPABILITY(mu)  the function checks at run time that mu is held
//   NO_THREAD_SAFETY_ANALYSIS  the function is not checked; its comment must say why
//
// Strata's own locks are common/mutex.h's Mutex, which carries the annotations. libstdc++'s
// std::mutex does not, so the analysis cannot see a field guarded by one.
#pragma once

#if defined(__clang__)
#define STRATA_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define STRATA_THREAD_ANNOTATION(x)
#endif

#ifndef GUARDED_BY
#define GUARDED_BY(x) STRATA_THREAD_ANNOTATION(guarded_by(x))
#endif
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(x) STRATA_THREAD_ANNOTATION(pt_guarded_by(x))
#endif
#ifndef REQUIRES
#define REQUIRES(...) STRATA_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) STRATA_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
#ifndef ACQUIRE
#define ACQUIRE(...) STRATA_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) STRATA_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#endif
#ifndef CAPABILITY
#define CAPABILITY(x) STRATA_THREAD_ANNOTATION(capability(x))
#endif
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY STRATA_THREAD_ANNOTATION(scoped_lockable)
#endif
#ifndef RETURN_CAPABILITY
#define RETURN_CAPABILITY(x) STRATA_THREAD_ANNOTATION(lock_returned(x))
#endif
#ifndef ASSERT_CAPABILITY
#define ASSERT_CAPABILITY(x) STRATA_THREAD_ANNOTATION(assert_capability(x))
#endif
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS STRATA_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif
