// Topology: world = dp x tp with the ranks of one tp group contiguous
// (rank = dp_rank * tp + tp_rank). Owns the world, tp and dp groups; nothing
// else creates process groups. Expert parallelism (ep > 1) cuts the dp
// dimension further, as DeepSpeed's MoE groups do: the ep group of a rank is ep
// contiguous dp ranks of the same tp rank (dp_rank = edp_rank * ep + ep_rank);
// they hold different experts and exchange tokens. The expert-data-parallel
// (edp) group is the dp ranks with the same ep rank: they hold the same experts
// and reduce and partition their gradients (docs/architecture.md).
#pragma once
#include <memory>

#include "autotp/comm/comm.h"
#include "autotp/comm/dist_env.h"
#include "autotp/comm/process_group.h"

namespace autotp {

struct TopologyOptions {
  int tp_size = 1;                                             // tensor_parallel.autotp_size
  int ep_size = 1;                                             // expert_parallel.autoep_size: divides dp
  Backend backend = Backend::kGloo;  // what moves CUDA tensors (nccl or gloo); CPU tensors always use Gloo
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // every collective and the rendezvous
  // Groups whose members all run on this host all-reduce through shared memory
  // (Gloo otherwise); AUTOTP_SHARED_MEMORY=0 in the environment turns it off.
  bool shared_memory = true;
};

class Topology {
 public:
  // Validates tp_size against world size (UserError: "autotp_size 3 does not divide world size 4")
  // and creates the groups (TCPStore rendezvous from env when world_size > 1).
  static std::shared_ptr<Topology> create(const DistEnv& env, const TopologyOptions& options = {});
  // A world of one process (tp = dp = 1).
  static std::shared_ptr<Topology> single();
  // Same as create() but over an existing store (tests with a FileStore).
  static std::shared_ptr<Topology> create_with_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                     int world_size, const TopologyOptions& options = {});

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int tp_size() const { return tp_size_; }
  int dp_size() const { return world_size_ / tp_size_; }
  int tp_rank() const { return rank_ % tp_size_; }
  int dp_rank() const { return rank_ / tp_size_; }
  int ep_size() const { return ep_size_; }
  int ep_rank() const { return dp_rank() % ep_size_; }
  int edp_size() const { return dp_size() / ep_size_; }
  int edp_rank() const { return dp_rank() / ep_size_; }

  // The mesh as pure functions (no groups needed), for planning and tests.
  // validate: UserError unless 1 <= tp_size and tp_size divides world_size.
  static void validate(int world_size, int tp_size);
  struct Coordinates {
    int dp_rank = 0, tp_rank = 0;
  };
  static Coordinates coordinates(int rank, int tp_size);
  // Global ranks of the tp group / dp group that `rank` belongs to, in group-rank order.
  static std::vector<int> tp_group_ranks(int rank, int world_size, int tp_size);
  static std::vector<int> dp_group_ranks(int rank, int world_size, int tp_size);
  // UserError unless ep_size >= 1 divides the dp size world / tp.
  static void validate_ep(int world_size, int tp_size, int ep_size);
  // Global ranks of the ep group / the expert-data-parallel group of `rank`, in group-rank order.
  static std::vector<int> ep_group_ranks(int rank, int world_size, int tp_size, int ep_size);
  static std::vector<int> edp_group_ranks(int rank, int world_size, int tp_size, int ep_size);

  // Waits for the groups' started collectives, then closes NCCL groups
  // explicitly: shutdown, or abort while an exception unwinds (a peer may be gone).
  ~Topology();

  Comm& world() { return *world_; }
  Comm& tp() { return *tp_; }
  Comm& dp() { return *dp_; }
  // Without expert parallelism the ep group is a group of one and edp is dp.
  Comm& ep() { return *ep_; }
  Comm& edp() { return ep_size_ == 1 ? *dp_ : *edp_; }

 private:
  int rank_ = 0, world_size_ = 1, tp_size_ = 1, ep_size_ = 1;
  c10::intrusive_ptr<c10d::Store> store_;  // kept alive with the groups (rank 0 hosts a TCPStore)
  std::unique_ptr<Comm> world_, tp_, dp_, ep_, edp_;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> nccl_groups_;  // closed by the destructor
};

}  // namespace autotp
