// What this rank is doing now (startup, forward of step 3, a checkpoint of step
// 4, ...), published for the launcher: when a rank dies, is stopped or hangs,
// the launcher reads its last phase and names it in the one error line of the
// run. Errors of collectives name it too ("... during backward of step 3").
//
// Publishing is a few stores into a small shared file mapping (the file named by
// AUTOTP_PHASE_FILE, set by the local launcher): no system call per change, so
// the trainer calls it per micro-batch. Outside a launcher only the in-process
// copy is kept. Thread safety: one publishing thread (the rank's main thread);
// readers of the file may be other processes (read_published_phase).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace autotp {

// Environment variable naming the phase file of this rank (set by launch_local).
inline constexpr const char* kPhaseFileVariable = "AUTOTP_PHASE_FILE";
// Test hook (docs/testing.md): "rank=R,phase=P[,step=S][,signal=KILL|STOP|TERM][,at=POINT]".
inline constexpr const char* kTestFaultVariable = "AUTOTP_TEST_FAULT";

// Sets this rank's phase. `phase` must be a string literal (it is kept by
// pointer): "startup", "rendezvous", "load", "forward", "backward", "optimizer",
// "checkpoint", "export", "done". `step`: the optimizer step it belongs to
// (1-based; the step being computed, or the step a checkpoint holds), -1 if none.
void publish_phase(const char* phase, int64_t step = -1);

// A named point inside the current phase (e.g. "rank_file_partly_written" in a
// checkpoint save). Publishes nothing; only the test hook can act on it.
void phase_point(const char* point);

// Reads AUTOTP_TEST_FAULT (once; publish_phase uses the same reading). Strict: a
// missing rank or phase, an unknown key, phase, point or signal, a rank or step
// that is not a non-negative integer is a UserError naming the variable, the bad
// part and the allowed values. Returns what the fault will do in this process
// ("rank 1 raises SIGKILL during backward of step 6"), or nullopt when the
// variable is unset or the fault is not armed here (another rank, no RANK, or a
// restarted world). The CLI calls it before anything else, so a bad value fails
// the run before any rank starts.
std::optional<std::string> armed_test_fault();

struct PublishedPhase {
  std::string phase;  // "" before the first publish_phase
  int64_t step = -1;
  // "backward of step 3", "startup", or "" when nothing was published.
  std::string describe() const;
};

// This process's current phase.
PublishedPhase current_phase();

// The phase another process published in `path` (its AUTOTP_PHASE_FILE);
// nullopt when the file is missing, empty or not a phase file.
std::optional<PublishedPhase> read_published_phase(const std::string& path);

}  // namespace autotp
