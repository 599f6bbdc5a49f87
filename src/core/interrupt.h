// A polite stop on SIGINT and SIGTERM: the first signal only sets a flag that a long-running loop polls
// at a point where stopping is safe (the trainer: after the step in progress, which it then saves); a
// second signal of either kind restores the default action and re-raises, so a second Ctrl-C ends the
// process at once.
//
// The handler is async-signal-safe: it stores the signal's number in a lock-free atomic, or calls
// sigaction and raise (both async-signal-safe) on the second signal; it never logs or allocates. Any
// thread may poll stop_requested(); the flag is never cleared except by reset_stop_for_tests().
#pragma once

namespace mt {

// Installs the handler for SIGINT and SIGTERM (SA_RESTART: interrupted system calls resume). Idempotent:
// a second call changes nothing and keeps a signal already received.
void install_stop_signals();
// Whether a stop signal has arrived since install_stop_signals (or the last reset_stop_for_tests).
bool stop_requested();
// The first stop signal received (SIGINT or SIGTERM), 0 when none.
int stop_signal();
// "SIGINT", "SIGTERM", or "signal N" for another number.
const char* stop_signal_name(int sig);
// Forgets a received signal, so the next one is again the first (the handlers stay installed).
void reset_stop_for_tests();

}  // namespace mt
