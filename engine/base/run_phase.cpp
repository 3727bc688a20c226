#include "autotp/base/run_phase.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "autotp/base/error.h"

namespace autotp {
namespace {

constexpr char kMagic[8] = {'a', 't', 'p', 'p', 'h', 's', 'e', '1'};
constexpr size_t kPhaseBytes = 32;

// The file's layout. A writer makes `sequence` odd while it changes the record
// and even after, so a reader of a running rank can tell a torn read.
struct PhaseRecord {
  char magic[8];
  std::atomic<uint32_t> sequence;
  uint32_t reserved;
  int64_t step;
  char phase[kPhaseBytes];
};
static_assert(sizeof(PhaseRecord) == 56, "the phase file's layout is fixed");
constexpr size_t kSequenceOffset = 8, kStepOffset = 16, kPhaseOffset = 24;

std::atomic<const char*> g_phase{""};
std::atomic<int64_t> g_step{-1};

PhaseRecord* map_phase_file() {
  const char* path = std::getenv(kPhaseFileVariable);
  if (path == nullptr || *path == '\0') return nullptr;
  const int fd = ::open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return nullptr;  // a phase the launcher cannot read is no reason to fail the run
  void* mapped = MAP_FAILED;
  if (::ftruncate(fd, sizeof(PhaseRecord)) == 0)
    mapped = ::mmap(nullptr, sizeof(PhaseRecord), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mapped == MAP_FAILED) return nullptr;
  auto* record = static_cast<PhaseRecord*>(mapped);
  std::memcpy(record->magic, kMagic, sizeof kMagic);
  return record;
}

PhaseRecord* phase_file() {
  static PhaseRecord* record = map_phase_file();
  return record;
}

// AUTOTP_TEST_FAULT: this rank signals itself when it reaches a phase (and step,
// and point). Parsed once; absent in production runs.
struct TestFault {
  bool armed = false;
  std::string phase, point;
  int64_t rank = -1, step = -1;
  int signo = SIGKILL;
  std::string signal_name = "SIGKILL";
};

// The phases publish_phase is called with, and the points phase_point is called
// with (a checkpoint save's, engine/checkpoint/checkpointing.cpp).
constexpr const char* kPhases[] = {"startup",   "rendezvous", "load",   "forward", "backward",
                                   "optimizer", "checkpoint", "export", "done"};
constexpr const char* kPoints[] = {"rank_file_partly_written", "rank_file_written", "metadata_written",
                                   "renamed"};
constexpr const char* kKeys[] = {"rank", "phase", "step", "signal", "at"};

template <size_t N>
bool is_one_of(const std::string& value, const char* const (&names)[N]) {
  return std::find(std::begin(names), std::end(names), value) != std::end(names);
}

TestFault parse_test_fault() {
  TestFault fault;
  const char* spec = std::getenv(kTestFaultVariable);
  if (spec == nullptr || *spec == '\0') return fault;
  const auto fail = [&](const std::string& what) {
    throw UserError(
        fmt::format("{}=\"{}\": {} (the form is rank=R,phase=P[,step=S][,signal=KILL|STOP|TERM][,at=POINT]; "
                    "docs/testing.md)",
                    kTestFaultVariable, spec, what));
  };
  const auto integer = [&](const std::string& key, const std::string& value) {
    const bool digits =
        !value.empty() && value.size() <= 18 && value.find_first_not_of("0123456789") == std::string::npos;
    if (!digits) fail(fmt::format("{}=\"{}\" is not a non-negative integer", key, value));
    return static_cast<int64_t>(std::stoll(value));
  };
  std::stringstream items(spec);
  std::string item;
  std::set<std::string> seen;
  while (std::getline(items, item, ',')) {
    const auto equals = item.find('=');
    if (equals == std::string::npos) fail(fmt::format("\"{}\" is not key=value", item));
    const std::string key = item.substr(0, equals), value = item.substr(equals + 1);
    if (!is_one_of(key, kKeys)) fail(fmt::format("unknown key \"{}\" (one of {})", key, fmt::join(kKeys, ", ")));
    if (!seen.insert(key).second) fail(fmt::format("{} given twice", key));
    if (key == "rank") fault.rank = integer(key, value);
    if (key == "step") fault.step = integer(key, value);
    if (key == "phase") {
      if (!is_one_of(value, kPhases))
        fail(fmt::format("unknown phase \"{}\" (one of {})", value, fmt::join(kPhases, ", ")));
      fault.phase = value;
    }
    if (key == "at") {
      if (!is_one_of(value, kPoints))
        fail(fmt::format("unknown point \"{}\" (one of {})", value, fmt::join(kPoints, ", ")));
      fault.point = value;
    }
    if (key == "signal") {
      if (value == "KILL" || value == "STOP" || value == "TERM") {
        fault.signo = value == "STOP" ? SIGSTOP : value == "TERM" ? SIGTERM : SIGKILL;
        fault.signal_name = "SIG" + value;
      } else {
        fail(fmt::format("unknown signal \"{}\" (one of KILL, STOP, TERM)", value));
      }
    }
  }
  if (std::string(spec).back() == ',') fail("an empty item after the last comma");
  if (fault.rank < 0) fail("rank is missing");
  if (fault.phase.empty()) fail("phase is missing");
  if (!fault.point.empty() && fault.phase != "checkpoint")
    fail(fmt::format("at={} is a point of phase checkpoint, not of {}", fault.point, fault.phase));
  // Only ranks: the process that launched them has no RANK. Only a world's first
  // attempt: a world restarted after the fault (--max-restarts) runs clean.
  const char* rank = std::getenv("RANK");
  const char* restart = std::getenv("AUTOTP_RESTART_COUNT");
  const bool first_attempt = restart == nullptr || std::string(restart) == "0";
  fault.armed = rank != nullptr && std::to_string(fault.rank) == rank && first_attempt;
  return fault;
}

const TestFault& test_fault() {
  static const TestFault fault = parse_test_fault();  // a throw leaves it unset: the next call throws again
  return fault;
}

void maybe_inject_fault(const char* point) {
  const TestFault& fault = test_fault();
  if (!fault.armed || fault.phase != g_phase.load() || fault.step != g_step.load() || fault.point != point)
    return;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  // The test measures the time to exit from this line.
  const std::string line =
      fmt::format("autotp: test fault: rank {} raises {} during {}{}{} at {} ns\n", fault.rank,
                  fault.signal_name, current_phase().describe(), *point ? " at " : "", point, now_ns);
  const ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
  ::raise(fault.signo);
}

}  // namespace

void publish_phase(const char* phase, int64_t step) {
  g_phase.store(phase);
  g_step.store(step);
  if (PhaseRecord* record = phase_file()) {
    const uint32_t sequence = record->sequence.load(std::memory_order_relaxed);
    record->sequence.store(sequence + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    record->step = step;
    std::strncpy(record->phase, phase, kPhaseBytes - 1);
    record->phase[kPhaseBytes - 1] = '\0';
    record->sequence.store(sequence + 2, std::memory_order_release);
  }
  maybe_inject_fault("");
}

void phase_point(const char* point) { maybe_inject_fault(point); }

std::optional<std::string> armed_test_fault() {
  const TestFault& fault = test_fault();
  if (!fault.armed) return std::nullopt;
  const std::string phase = PublishedPhase{fault.phase, fault.step}.describe();
  return fmt::format("rank {} raises {} during {}{}{}", fault.rank, fault.signal_name, phase,
                     fault.point.empty() ? "" : " at ", fault.point);
}

std::string PublishedPhase::describe() const {
  if (step < 0) return phase;
  return fmt::format("{} of step {}", phase, step);
}

PublishedPhase current_phase() { return {g_phase.load(), g_step.load()}; }

std::optional<PublishedPhase> read_published_phase(const std::string& path) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    // Two equal reads with an even sequence: not torn by a change in between.
    char bytes[sizeof(PhaseRecord)], again[sizeof(PhaseRecord)];
    std::ifstream in(path, std::ios::binary);
    if (!in.read(bytes, sizeof bytes)) return std::nullopt;
    if (std::memcmp(bytes, kMagic, sizeof kMagic) != 0) return std::nullopt;
    in.seekg(0);
    if (!in.read(again, sizeof again)) return std::nullopt;
    uint32_t sequence = 0;
    int64_t step = 0;
    std::memcpy(&sequence, bytes + kSequenceOffset, sizeof sequence);
    if (sequence % 2 != 0 || std::memcmp(bytes, again, sizeof bytes) != 0) continue;
    std::memcpy(&step, bytes + kStepOffset, sizeof step);
    const char* phase = bytes + kPhaseOffset;
    return PublishedPhase{std::string(phase, strnlen(phase, kPhaseBytes)), step};
  }
  return std::nullopt;
}

}  // namespace autotp
