#include "autotp/comm/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <exception>

#include "autotp/comm/shared_memory_transport.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"

namespace autotp {
namespace {

std::vector<int> divisors(int n) {
  std::vector<int> result;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) result.push_back(d);
  }
  return result;
}

// Rendezvous failures (a rank that never came, a timeout) name the group.
c10::intrusive_ptr<c10d::ProcessGroup> open_group(const TopologyOptions& options,
                                                  const c10::intrusive_ptr<c10d::Store>& store,
                                                  const std::string& prefix, int group_rank, int group_size,
                                                  int global_rank) {
  try {
    return create_process_group(options.backend, prefix_store(prefix, store), group_rank, group_size,
                                options.timeout);
  } catch (const c10::Error& error) {
    throw std::runtime_error(fmt::format("rank {}: creating process group '{}' ({} ranks) failed: {}",
                                         global_rank, prefix, group_size, error.what_without_backtrace()));
  }
}

// A one-member group: no process group, no communication.
std::unique_ptr<Comm> solo(int global_rank, const char* name) {
  return std::make_unique<Comm>(c10::intrusive_ptr<c10d::ProcessGroup>(), std::vector<int>{global_rank},
                                name);
}

// All-reduces of a group whose members share this host go through shared
// memory; the rendezvous runs in the group's own corner of the store.
void attach_shared_memory(Comm& comm, const TopologyOptions& options, const c10::intrusive_ptr<c10d::Store>& store,
                          const std::string& prefix) {
  if (!options.shared_memory || comm.size() == 1) return;
  SharedMemoryOptions shm;
  shm.timeout = options.timeout;
  comm.use_shared_memory(SharedMemoryTransport::create(prefix_store(prefix + "/shm", store), comm.rank(),
                                                       comm.size(), shm));
}

}  // namespace

void Topology::validate(int world_size, int tp_size) {
  TORCH_CHECK(world_size >= 1, "Topology: world size ", world_size, " must be at least 1");
  if (tp_size < 1 || world_size % tp_size != 0) {
    throw_user_error("autotp_size {} does not divide world size {} (allowed: {})", tp_size, world_size,
                     fmt::join(divisors(world_size), ", "));
  }
}

Topology::Coordinates Topology::coordinates(int rank, int tp_size) {
  TORCH_CHECK(rank >= 0 && tp_size >= 1, "Topology::coordinates: bad rank ", rank, " or tp size ", tp_size);
  return {rank / tp_size, rank % tp_size};
}

std::vector<int> Topology::tp_group_ranks(int rank, int world_size, int tp_size) {
  validate(world_size, tp_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "Topology: rank ", rank, " outside world of ", world_size);
  std::vector<int> ranks;
  const int first = coordinates(rank, tp_size).dp_rank * tp_size;
  for (int t = 0; t < tp_size; ++t) ranks.push_back(first + t);
  return ranks;
}

std::vector<int> Topology::dp_group_ranks(int rank, int world_size, int tp_size) {
  validate(world_size, tp_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "Topology: rank ", rank, " outside world of ", world_size);
  std::vector<int> ranks;
  const int tp_rank = coordinates(rank, tp_size).tp_rank;
  for (int d = 0; d < world_size / tp_size; ++d) ranks.push_back(d * tp_size + tp_rank);
  return ranks;
}

void Topology::validate_ep(int world_size, int tp_size, int ep_size) {
  validate(world_size, tp_size);
  const int dp = world_size / tp_size;
  if (ep_size < 1 || dp % ep_size != 0)
    throw_user_error("autoep_size {} does not divide world size / autotp_size = {} (allowed: {})", ep_size, dp,
                     fmt::join(divisors(dp), ", "));
}

std::vector<int> Topology::ep_group_ranks(int rank, int world_size, int tp_size, int ep_size) {
  validate_ep(world_size, tp_size, ep_size);
  const auto [dp_rank, tp_rank] = coordinates(rank, tp_size);
  std::vector<int> ranks;
  const int first = dp_rank / ep_size * ep_size;
  for (int e = 0; e < ep_size; ++e) ranks.push_back((first + e) * tp_size + tp_rank);
  return ranks;
}

std::vector<int> Topology::edp_group_ranks(int rank, int world_size, int tp_size, int ep_size) {
  validate_ep(world_size, tp_size, ep_size);
  const auto [dp_rank, tp_rank] = coordinates(rank, tp_size);
  std::vector<int> ranks;
  for (int d = dp_rank % ep_size; d < world_size / tp_size; d += ep_size) ranks.push_back(d * tp_size + tp_rank);
  return ranks;
}

Topology::~Topology() {
  const bool unwinding = std::uncaught_exceptions() > 0;
  edp_.reset();
  ep_.reset();
  dp_.reset();
  tp_.reset();
  world_.reset();
  for (auto& group : nccl_groups_) close_process_group(group, /*abort=*/unwinding);
}

std::shared_ptr<Topology> Topology::single() {
  auto topology = std::shared_ptr<Topology>(new Topology());
  topology->world_ = solo(0, "world");
  topology->tp_ = solo(0, "tp");
  topology->dp_ = solo(0, "dp");
  topology->ep_ = solo(0, "ep");
  return topology;
}

std::shared_ptr<Topology> Topology::create(const DistEnv& env, const TopologyOptions& options) {
  validate_ep(env.world_size, options.tp_size, options.ep_size);
  if (env.world_size == 1) return single();
  StoreOptions store_options;
  store_options.timeout = options.timeout;
  return create_with_store(create_tcp_store(env, store_options), env.rank, env.world_size, options);
}

std::shared_ptr<Topology> Topology::create_with_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                      int world_size, const TopologyOptions& options) {
  validate_ep(world_size, options.tp_size, options.ep_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "Topology: rank ", rank, " outside world of ", world_size);
  if (world_size == 1) return single();

  auto topology = std::shared_ptr<Topology>(new Topology());
  topology->rank_ = rank;
  topology->world_size_ = world_size;
  topology->tp_size_ = options.tp_size;
  topology->store_ = store;
  const auto [dp_rank, tp_rank] = coordinates(rank, options.tp_size);
  const int tp_size = options.tp_size;
  const int dp_size = world_size / tp_size;

  // Every rank builds the world group, then its own tp group, then its own dp
  // group. A Gloo group's rendezvous involves only its members, and each member
  // reaches its groups in the same order, so no rank waits on a group it is not in.
  // Each group gets its own key prefix in the shared store.
  std::vector<int> all(world_size);
  for (int r = 0; r < world_size; ++r) all[r] = r;
  auto opened = [&](c10::intrusive_ptr<c10d::ProcessGroup> group) {
    if (options.backend == Backend::kNccl) topology->nccl_groups_.push_back(group);
    return group;
  };
  auto world_group = opened(open_group(options, store, "world", rank, world_size, rank));
  topology->world_ = std::make_unique<Comm>(world_group, all, "world", options.backend);
  attach_shared_memory(*topology->world_, options, store, "world");

  // A tp (dp) group that spans the world reuses the world's process group
  // rather than opening a second full mesh of connections.
  if (tp_size == 1) {
    topology->tp_ = solo(rank, "tp");
  } else if (tp_size == world_size) {
    // Shares the world's group, so it shares the world's transport and lane too.
    topology->tp_ = std::make_unique<Comm>(world_group, all, "tp", options.backend);
    topology->tp_->share_lane_with(*topology->world_);
    if (topology->world_->uses_shared_memory()) topology->tp_->use_shared_memory(topology->world_->shared_memory());
  } else {
    const std::string prefix = fmt::format("tp/{}", dp_rank);
    auto group = opened(open_group(options, store, prefix, tp_rank, tp_size, rank));
    topology->tp_ = std::make_unique<Comm>(group, tp_group_ranks(rank, world_size, tp_size), "tp", options.backend);
    attach_shared_memory(*topology->tp_, options, store, prefix);
  }
  c10::intrusive_ptr<c10d::ProcessGroup> dp_group;  // kept for an ep group that spans dp
  if (dp_size == 1) {
    topology->dp_ = solo(rank, "dp");
  } else if (dp_size == world_size) {
    dp_group = world_group;
    topology->dp_ = std::make_unique<Comm>(world_group, all, "dp", options.backend);
    topology->dp_->share_lane_with(*topology->world_);
    if (topology->world_->uses_shared_memory()) topology->dp_->use_shared_memory(topology->world_->shared_memory());
  } else {
    const std::string prefix = fmt::format("dp/{}", tp_rank);
    auto group = opened(open_group(options, store, prefix, dp_rank, dp_size, rank));
    dp_group = group;
    topology->dp_ = std::make_unique<Comm>(group, dp_group_ranks(rank, world_size, tp_size), "dp", options.backend);
    attach_shared_memory(*topology->dp_, options, store, prefix);
  }
  // Expert parallelism: the ep group (after dp, every rank in the same order), then the edp group.
  const int ep_size = options.ep_size;
  topology->ep_size_ = ep_size;
  const int ep_rank = dp_rank % ep_size, edp_rank = dp_rank / ep_size;
  if (ep_size == 1) {
    topology->ep_ = solo(rank, "ep");
  } else if (ep_size == dp_size) {  // the dp group itself: its process group, transport and lane
    topology->ep_ = std::make_unique<Comm>(dp_group, topology->dp_->global_ranks(), "ep", options.backend);
    topology->ep_->share_lane_with(*topology->dp_);
    if (topology->dp_->uses_shared_memory()) topology->ep_->use_shared_memory(topology->dp_->shared_memory());
    topology->edp_ = solo(rank, "edp");
  }
  if (ep_size > 1 && ep_size < dp_size) {
    const std::string ep_prefix = fmt::format("ep/{}/{}", tp_rank, edp_rank);
    auto ep_group = opened(open_group(options, store, ep_prefix, ep_rank, ep_size, rank));
    topology->ep_ = std::make_unique<Comm>(ep_group, ep_group_ranks(rank, world_size, tp_size, ep_size), "ep",
                                           options.backend);
    attach_shared_memory(*topology->ep_, options, store, ep_prefix);
    // ep < dp: the edp group has dp / ep >= 2 members.
    const std::string edp_prefix = fmt::format("edp/{}/{}", tp_rank, ep_rank);
    auto edp_group = opened(open_group(options, store, edp_prefix, edp_rank, dp_size / ep_size, rank));
    topology->edp_ = std::make_unique<Comm>(edp_group, edp_group_ranks(rank, world_size, tp_size, ep_size), "edp",
                                            options.backend);
    attach_shared_memory(*topology->edp_, options, store, edp_prefix);
  }
  log().debug("topology: rank {} of {} -> dp {} of {}, tp {} of {}, shared-memory all-reduce {}", rank, world_size,
              dp_rank, dp_size, tp_rank, tp_size, topology->world_->uses_shared_memory() ? "on" : "off");
  return topology;
}

}  // namespace autotp
