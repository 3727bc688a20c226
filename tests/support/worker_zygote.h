// A fork server for the ranks of multi-process tests. Each exec of a test binary
// spends about 0.6 CPU-seconds in LibTorch's static initialisation (registering
// its operators) before main; a 4-rank test paid that 5 times for a 1-second
// check. test_main starts this server first thing in main, while the process is
// still one thread and has run no LibTorch op, so a child forked from it is in
// the state an exec would reach at main, LibTorch loaded. run_workers passes the
// server's spawner to the launcher; each rank is then cloned from the server
// with CLONE_PARENT, so it is the test process's own child (waited for and
// signalled as a spawned rank is), gets the launcher's environment, descriptors
// and argv, and runs the worker entry as main would.
//
// AUTOTP_TEST_ZYGOTE=0 turns it off (every rank an exec, as the CLI's launcher
// always does); it is off in sanitizer builds and wherever the process already
// has more than one thread when main starts.
#pragma once
#include "launcher/launcher.h"

namespace autotp::test {

using WorkerEntry = int (*)(int argc, char** argv);

// Forks the server, which will run `entry(argc, argv)` in each rank and exit with
// its result. Call first thing in main; does nothing when turned off.
void start_worker_zygote(WorkerEntry entry);

// The launcher's spawner for the running server, or an empty one (exec) when
// there is none.
launcher::RankSpawner worker_zygote_spawner();

}  // namespace autotp::test
