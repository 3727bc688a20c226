#include "autotp/comm/shared_memory_transport.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>

#include <fmt/format.h>

namespace autotp {
namespace {

constexpr int kMaxMembers = 64;
constexpr size_t kLine = 64;  // one counter per cache line, so ranks do not share lines

struct alignas(kLine) Counter {
  std::atomic<int64_t> generation{0};
};
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared-memory counters need lock-free 64-bit atomics");

Counter* counters(void* mapping) { return static_cast<Counter*>(mapping); }

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

// Same host means the same hostname and the same kernel boot: containers on one
// machine that share /dev/shm qualify, two machines with equal names do not.
std::string host_identity() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

// A process that exited (or is a zombie not yet reaped) is gone.
bool process_alive(int64_t pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  if (!stat) return false;
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

// Members of one group that run in one process (the rank threads of
// tests/test_shared_memory_threads.cpp) share one mapping of the segment: the
// same addresses, so ThreadSanitizer sees their hand-over (separate mappings of
// one segment would hide it behind different addresses). Null when it cannot be mapped.
std::shared_ptr<void> map_segment(const std::string& name, size_t bytes) {
  static std::mutex mutex;
  static auto* live = new std::map<std::string, std::weak_ptr<void>>();  // leaked: outlives static destructors
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = live->begin(); it != live->end();) it = it->second.expired() ? live->erase(it) : std::next(it);
  if (auto found = live->find(name); found != live->end()) return found->second.lock();
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  void* mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (mapping == MAP_FAILED) return nullptr;
  std::shared_ptr<void> shared(mapping, [bytes](void* address) { munmap(address, bytes); });
  (*live)[name] = shared;
  return shared;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

std::shared_ptr<SharedMemoryTransport> SharedMemoryTransport::create(const c10::intrusive_ptr<c10d::Store>& store,
                                                                     int rank, int size,
                                                                     const SharedMemoryOptions& options) {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "SharedMemoryTransport: rank ", rank, " of ", size);
  TORCH_CHECK(options.slot_bytes >= 64 && options.slot_bytes % 64 == 0,
              "SharedMemoryTransport: slot_bytes must be a positive multiple of 64, got ", options.slot_bytes);
  if (size == 1 || size > kMaxMembers) return nullptr;
  const size_t header = kMaxMembers * sizeof(Counter);
  const size_t total = header + 2 * static_cast<size_t>(size) * options.slot_bytes;

  store->set(fmt::format("host/{}", rank), bytes_of(fmt::format("{} {}", host_identity(), getpid())));
  std::vector<int64_t> pids(size);
  bool one_host = true;
  const std::string mine = host_identity();
  for (int r = 0; r < size; ++r) {
    const std::string entry = text_of(store->get(fmt::format("host/{}", r)));
    const auto space = entry.rfind(' ');
    one_host = one_host && entry.substr(0, space) == mine;
    pids[r] = std::stoll(entry.substr(space + 1));
  }

  // Rank 0 names and sizes the segment ("" = no shared memory for this group).
  std::string name;
  if (rank == 0) {
    const char* enabled = std::getenv("AUTOTP_SHARED_MEMORY");
    const bool wanted = one_host && !(enabled && std::string(enabled) == "0");
    if (wanted) {
      std::random_device random;
      name = fmt::format("/autotp-{}-{:08x}", getpid(), random());
      const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      // Reserve the pages now: a small /dev/shm (a container's default 64 MB)
      // then means falling back to Gloo here, not SIGBUS on first touch later.
      if (fd < 0 || posix_fallocate(fd, 0, static_cast<off_t>(total)) != 0) {
        if (fd >= 0) {
          close(fd);
          shm_unlink(name.c_str());
        }
        name.clear();
      } else {
        close(fd);
      }
    }
    store->set("name", bytes_of(name));
  } else {
    name = text_of(store->get("name"));
  }
  if (name.empty()) return nullptr;

  auto transport = std::shared_ptr<SharedMemoryTransport>(new SharedMemoryTransport());
  transport->rank_ = rank;
  transport->size_ = size;
  transport->options_ = options;
  transport->member_pids_ = pids;
  transport->segment_ = map_segment(name, total);
  transport->mapping_ = transport->segment_.get();
  // Every member reports; all keep the segment only if all mapped it.
  store->set(fmt::format("mapped/{}", rank), bytes_of(transport->mapping_ ? "1" : "0"));
  bool all_mapped = true;
  for (int r = 0; r < size; ++r) all_mapped = all_mapped && text_of(store->get(fmt::format("mapped/{}", r))) == "1";
  if (rank == 0) shm_unlink(name.c_str());  // every member holds a mapping (or gave up): no file left behind
  if (!all_mapped) return nullptr;
  return transport;
}

SharedMemoryTransport::~SharedMemoryTransport() = default;  // the last member of this process unmaps

uint8_t* SharedMemoryTransport::slot(int64_t set, int member) const {
  const size_t header = kMaxMembers * sizeof(Counter);
  return static_cast<uint8_t*>(mapping_) + header +
         (static_cast<size_t>(set) * size_ + member) * static_cast<size_t>(options_.slot_bytes);
}

void SharedMemoryTransport::wait_for_all(int64_t generation) {
  Counter* c = counters(mapping_);
  int64_t spins = 0;
  auto deadline = std::chrono::steady_clock::time_point::max();
  auto next_check = std::chrono::steady_clock::time_point::min();
  for (int member = 0; member < size_;) {
    if (c[member].generation.load(std::memory_order_acquire) >= generation) {
      ++member;
      continue;
    }
    if (++spins < 2000) {
      cpu_relax();
      continue;
    }
    sched_yield();
    if (spins % 64 != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    if (deadline == std::chrono::steady_clock::time_point::max()) deadline = now + options_.timeout;
    if (now >= deadline)
      throw std::runtime_error(fmt::format("shared-memory all-reduce timed out after {} ms waiting for rank {}",
                                           options_.timeout.count(), member));
    if (now >= next_check) {
      if (!process_alive(member_pids_[member]))
        throw std::runtime_error(fmt::format("shared-memory all-reduce: rank {} (pid {}) has exited", member,
                                             member_pids_[member]));
      next_check = now + std::chrono::milliseconds(20);
    }
  }
}

int64_t SharedMemoryTransport::exchange(const void* data, int64_t bytes) { return exchange(data, bytes, 0, 0); }

int64_t SharedMemoryTransport::exchange(const void* data, int64_t bytes, int64_t skip_begin, int64_t skip_end) {
  const int64_t generation = ++generation_;
  const int64_t set = generation % 2;
  skip_begin = std::clamp<int64_t>(skip_begin, 0, bytes);
  skip_end = std::clamp<int64_t>(skip_end, skip_begin, bytes);
  auto* to = slot(set, rank_);
  const auto* from = static_cast<const uint8_t*>(data);
  if (skip_begin > 0) std::memcpy(to, from, static_cast<size_t>(skip_begin));
  if (bytes > skip_end) std::memcpy(to + skip_end, from + skip_end, static_cast<size_t>(bytes - skip_end));
  counters(mapping_)[rank_].generation.store(generation, std::memory_order_release);
  wait_for_all(generation);
  return set;
}

int64_t SharedMemoryTransport::publish(const std::function<void(uint8_t* slot)>& fill) {
  const int64_t generation = ++generation_;
  const int64_t set = generation % 2;
  fill(slot(set, rank_));
  counters(mapping_)[rank_].generation.store(generation, std::memory_order_release);
  wait_for_all(generation);
  return set;
}

void SharedMemoryTransport::all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                                       const std::vector<int64_t>& recv_bytes) {
  TORCH_CHECK(static_cast<int>(send_bytes.size()) == size_ && static_cast<int>(recv_bytes.size()) == size_,
              "SharedMemoryTransport::all_to_all: ", send_bytes.size(), " send and ", recv_bytes.size(),
              " receive sizes for ", size_, " members");
  std::vector<int64_t> send_at(size_ + 1, 0), recv_at(size_ + 1, 0);
  for (int r = 0; r < size_; ++r) {
    send_at[r + 1] = send_at[r] + send_bytes[r];
    recv_at[r + 1] = recv_at[r] + recv_bytes[r];
  }
  // This member's own piece never enters the segment.
  std::memcpy(recv + recv_at[rank_], send + send_at[rank_], static_cast<size_t>(send_bytes[rank_]));
  // A slot: a 64-byte header (this member's largest piece, sent or received), then one
  // cache-line-aligned sub-slot per receiver. Every member must run the same rounds:
  // the first round's headers tell each the largest piece of all.
  constexpr int64_t kHeader = 64;
  const int64_t sub = (options_.slot_bytes - kHeader) / size_ / 64 * 64;
  TORCH_CHECK(sub > 0, "SharedMemoryTransport::all_to_all: slots of ", options_.slot_bytes, " bytes are too small for ",
              size_, " members");
  int64_t largest = 0;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) largest = std::max({largest, send_bytes[r], recv_bytes[r]});
  int64_t rounds = 1;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t offset = round * sub;
    const int64_t set = publish([&](uint8_t* mine) {
      std::memcpy(mine, &largest, sizeof(largest));
      for (int to = 0; to < size_; ++to) {
        const int64_t n = std::clamp<int64_t>(send_bytes[to] - offset, 0, sub);
        if (to != rank_ && n > 0)
          std::memcpy(mine + kHeader + to * sub, send + send_at[to] + offset, static_cast<size_t>(n));
      }
    });
    if (round == 0) {
      int64_t most = 0;
      for (int r = 0; r < size_; ++r) {
        int64_t theirs = 0;
        std::memcpy(&theirs, slot(set, r), sizeof(theirs));
        most = std::max(most, theirs);
      }
      rounds = std::max<int64_t>(1, (most + sub - 1) / sub);
    }
    for (int from = 0; from < size_; ++from) {
      const int64_t n = std::clamp<int64_t>(recv_bytes[from] - offset, 0, sub);
      if (from != rank_ && n > 0)
        std::memcpy(recv + recv_at[from] + offset, slot(set, from) + kHeader + rank_ * sub, static_cast<size_t>(n));
    }
  }
}

torch::Tensor SharedMemoryTransport::reduce_scatter(const torch::Tensor& full, int64_t begin, int64_t length,
                                                    torch::Tensor out_given) {
  TORCH_CHECK(full.is_contiguous() && begin >= 0 && length >= 0 && begin + length <= full.numel(),
              "SharedMemoryTransport::reduce_scatter: range [", begin, ", ", begin + length, ") of a ",
              full.numel(), "-element tensor");
  torch::NoGradGuard no_grad;
  const int64_t element = static_cast<int64_t>(full.element_size());
  const int64_t chunk = options_.slot_bytes / element;
  auto flat = full.view({-1});
  // 16-bit floats travel as they are and are summed in fp32 (the result is fp32).
  const bool widen = full.scalar_type() == torch::kBFloat16 || full.scalar_type() == torch::kFloat16;
  const auto result_options = widen ? full.options().dtype(torch::kFloat32) : full.options();
  TORCH_CHECK(!out_given.defined() || (out_given.is_contiguous() && out_given.numel() == length &&
                                       out_given.scalar_type() == result_options.dtype().toScalarType()),
              "SharedMemoryTransport::reduce_scatter: the output must be ", length, " contiguous elements");
  auto result = out_given.defined() ? out_given.view({-1}) : torch::empty({length}, result_options);
  for (int64_t offset = 0; offset < flat.numel(); offset += chunk) {
    const int64_t count = std::min(chunk, flat.numel() - offset);
    // This member's range within the chunk: nobody else reads it, so it is not
    // copied out; it is summed with every other member's copy in rank order.
    const int64_t lo = std::max(offset, begin), hi = std::min(offset + count, begin + length);
    const int64_t set = exchange(flat.narrow(0, offset, count).data_ptr(), count * element,
                                 lo < hi ? (lo - offset) * element : 0, lo < hi ? (hi - offset) * element : 0);
    if (lo >= hi) continue;
    auto member = [&](int r) {
      if (r == rank_) return flat.narrow(0, lo, hi - lo);
      return torch::from_blob(slot(set, r) + (lo - offset) * element, {hi - lo}, full.options());
    };
    auto out = result.narrow(0, lo - begin, hi - lo);
    if (size_ == 1 || widen) {
      out.copy_(member(0));
      for (int r = 1; r < size_; ++r) out.add_(member(r));
      continue;
    }
    at::add_out(out, member(0), member(1));
    for (int r = 2; r < size_; ++r) out.add_(member(r));
  }
  return result;
}

void SharedMemoryTransport::all_gather(const torch::Tensor& local, torch::Tensor& out) {
  TORCH_CHECK(local.is_contiguous() && out.is_contiguous() && out.numel() == local.numel() * size_,
              "SharedMemoryTransport::all_gather: ", out.numel(), " output elements for ", size_, " blocks of ",
              local.numel());
  const int64_t element = static_cast<int64_t>(local.element_size());
  const int64_t chunk = options_.slot_bytes / element;
  const int64_t block = local.numel();
  auto* destination = static_cast<uint8_t*>(out.data_ptr());
  const auto* source = static_cast<const uint8_t*>(local.data_ptr());
  for (int64_t offset = 0; offset < block; offset += chunk) {
    const int64_t count = std::min(chunk, block - offset);
    const int64_t set = exchange(source + offset * element, count * element);
    for (int r = 0; r < size_; ++r) {
      uint8_t* to = destination + (r * block + offset) * element;
      if (to == source + offset * element) continue;  // in place: this rank's own block is already there
      std::memcpy(to, slot(set, r), static_cast<size_t>(count * element));
    }
  }
}

void SharedMemoryTransport::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  TORCH_CHECK(tensor.is_contiguous(), "SharedMemoryTransport::all_reduce needs a contiguous tensor");
  torch::NoGradGuard no_grad;
  const int64_t element = static_cast<int64_t>(tensor.element_size());
  const int64_t chunk = options_.slot_bytes / element;
  auto flat = tensor.view({-1});
  const auto options = tensor.options();
  Counter* c = counters(mapping_);
  for (int64_t offset = 0; offset < flat.numel(); offset += chunk) {
    const int64_t length = std::min(chunk, flat.numel() - offset);
    const int64_t generation = ++generation_;
    const int64_t set = generation % 2;
    auto out = flat.narrow(0, offset, length);
    std::memcpy(slot(set, rank_), out.data_ptr(), static_cast<size_t>(length * element));
    c[rank_].generation.store(generation, std::memory_order_release);
    wait_for_all(generation);
    auto member = [&](int r) { return torch::from_blob(slot(set, r), {length}, options); };
    // The same order on every rank: bit-identical results everywhere.
    switch (op) {
      case ReduceOp::kSum:
        at::add_out(out, member(0), member(1));
        for (int r = 2; r < size_; ++r) out.add_(member(r));
        break;
      case ReduceOp::kMax:
        at::maximum_out(out, member(0), member(1));
        for (int r = 2; r < size_; ++r) at::maximum_out(out, out, member(r));
        break;
      case ReduceOp::kMin:
        at::minimum_out(out, member(0), member(1));
        for (int r = 2; r < size_; ++r) at::minimum_out(out, out, member(r));
        break;
    }
  }
}

}  // namespace autotp
