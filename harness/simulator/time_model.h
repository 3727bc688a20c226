// Step time of a layout on a cluster, built from the operations this engine
// runs (docs/simulator.md): every GEMM of the forward, backward and any
// recomputation at its local shape, the elementwise ops of each layer, the
// optimizer's passes over its partition, and every collective the engine
// issues (tp: row-layer all-reduces in the forward, column-layer input-gradient
// all-reduces in the backward, vocab-parallel embedding / cross-entropy; ZeRO:
// bucketed gradient reduction, partition all-gathers, stage-3 layer gathers).
// With the layout's overlap_comm (the engine's default), ZeRO collectives the
// engine runs on its lane hide behind the compute beside them (zero_traffic.h),
// up to that compute; not on cpu-local, where communication uses the same cores.
#pragma once
#include <nlohmann/json.hpp>
#include <vector>

#include "autotp/arch/model_flops.h"
#include "simulator/cluster_catalog.h"
#include "simulator/memory_model.h"
#include "simulator/rank_shape.h"

namespace autotp::sim {

// kAllToAll: each rank sends (n-1)/n of its buffer to the others (expert parallelism's
// token exchange), priced as an all-gather of that buffer (the same bytes per rank).
enum class CollectiveOp { kAllReduce, kAllGather, kReduceScatter, kAllToAll };

// Which link a group uses on a cluster: tp groups are contiguous ranks (inside a
// node when tp divides the node), dp groups stride by tp (across nodes when the
// world is larger than one node).
enum class GroupScope { kIntraNode, kInterNode };

// One collective of `bytes` (all-reduce: the buffer; all-gather: the gathered
// output; reduce-scatter: the full input; all-to-all: what one rank sends, its own
// share included) over `group` ranks.
double collective_seconds(const ClusterSpec& cluster, CollectiveOp op, double bytes, int group, GroupScope scope);
// cpu-local: the calibration's costs in `dtype` (measured, else the grid's rate); GPUs: peak x efficiency.
double gemm_seconds(const ClusterSpec& cluster, const GemmShape& shape, torch::ScalarType dtype);

struct TimeEstimate {
  double compute_s = 0;
  double tp_comm_s = 0;
  double zero_comm_s = 0;
  double overlap_s = 0;
  double step_s = 0;
  double gemm_s = 0;         // part of compute_s
  double elementwise_s = 0;  // part of compute_s
  double dispatch_s = 0;     // part of compute_s: cpu-local's counted ops and nodes x the measured cost of one (op_count.h)
  double counted_ops = 0, counted_nodes = 0;  // per micro-batch: what dispatch_s prices (op_count.h)
  double overhead_s = 0;     // part of compute_s: cpu-local's measured framework overhead (a share of GEMM + elementwise)
  double optimizer_s = 0;    // part of compute_s
  int64_t tp_collectives = 0, zero_collectives = 0;  // per step
  // Expert parallelism: the token exchanges (all-to-alls of the ep group; on the
  // critical path, not overlapped), their count per step and the bytes this rank sends
  // to other ranks per step (docs/simulator.md, "Expert parallelism").
  double ep_comm_s = 0;
  int64_t ep_collectives = 0;
  double ep_bytes = 0;
  // ZeRO-Offload (docs/simulator.md): PCIe bytes per step of this rank, the
  // link's busy seconds, and the three components it adds to the step.
  int64_t pcie_d2h_bytes = 0;       // the reduced gradient partition, device -> host
  int64_t pcie_h2d_bytes = 0;       // updated parameters (or offload_param's gather slices), host -> device
  double pcie_d2h_s = 0, pcie_h2d_s = 0;  // at the host link's rate
  double offload_d2h_exposed_s = 0;  // of pcie_d2h_s, not behind the last micro-batch's backward
  double cpu_adam_s = 0;             // the host's update of the partition (not on the device)
  double offload_h2d_exposed_s = 0;  // of pcie_h2d_s, not behind the host update / the gathers' compute
  double model_flops = 0;    // per step, all ranks: 6 N tokens + attention (no recomputation)
  double executed_flops = 0; // per step per rank, GEMMs as the engine runs them (with recomputation)
  nlohmann::json to_json() const;
};

// Expert parallelism: the all-to-alls of one micro-batch's sparse layers (docs/simulator.md).
struct ExpertExchanges {
  int64_t exchanges = 0;       // hidden-state all-to-alls: 2 per sparse layer forward, 2 backward, 2 more recomputed
  int64_t count_exchanges = 0; // the per-expert row counts' all-to-all of every forward (recomputed too)
  double bytes = 0;            // one hidden-state exchange's buffer on the busiest rank (its own share included)
  double bytes_out = 0;        // of it, what leaves the rank: (ep - 1) / ep under balanced routing
};
ExpertExchanges expert_exchanges(const ModelConfig& config, const RankShape& shape, const SimLayout& layout);
// The link of the ep group: ep dp ranks of one tp rank, ep x tp consecutive ranks; inside a
// node when the world is one node or the span divides the node, else the NIC prices all of it.
GroupScope expert_parallel_scope(const ClusterSpec& cluster, const SimLayout& layout);

// The GEMMs one rank runs for one micro-batch (forward, backward, recomputation), with counts.
std::vector<std::pair<GemmShape, double>> step_gemms(const ModelConfig& config, const RankShape& shape,
                                                     const SimLayout& layout);

TimeEstimate estimate_time(const ModelConfig& config, const RankShape& shape, const SimLayout& layout,
                           const ClusterSpec& cluster);

// Elements one ZeRO-3 gather of the flat span `range` moves over `dp` ranks of a
// `padded`-element buffer: Comm::all_gather pads every rank's block to the largest
// share of the span that one dp partition holds.
double zero3_gather_elements(const FlatRange& range, int64_t padded, int dp);

}  // namespace autotp::sim
