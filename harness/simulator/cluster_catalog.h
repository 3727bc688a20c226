// Clusters the simulator knows: GPU nodes described by their datasheet figures
// (with an explicit achievable fraction for GEMMs and links), and `cpu-local`,
// this machine as measured by a calibration file. A GPU cluster with more GPUs
// than one node is that many identical nodes joined by one NIC per GPU.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "simulator/calibration.h"

namespace autotp::sim {

// One kind of link: seconds = latency + factor * bytes / bus_bytes_per_s
// (factor: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n).
struct LinkSpec {
  double latency_s = 0;
  double bus_bytes_per_s = 1;
};

struct ClusterSpec {
  std::string name;
  std::string description;
  std::string sources;            // where the figures come from
  // What the time model assumes rather than measures on this cluster (GPU clusters:
  // the GEMM efficiency and the links' share of their bandwidth); empty for cpu-local.
  std::string assumptions;
  int gpus_per_node = 8;
  int64_t memory_bytes = 0;       // per GPU (per rank on cpu-local)
  int64_t reserved_bytes = 0;     // per GPU, not available to tensors (CUDA context, NCCL, allocator slack)
  double peak_flops_16bit = 0;    // dense bf16/fp16 tensor-core FLOP/s per GPU
  double peak_flops_32bit = 0;    // fp32 FLOP/s per GPU (TF32 tensor cores are not assumed)
  double gemm_efficiency = 0.7;   // fraction of peak a large training GEMM reaches
  double memory_bytes_per_s = 0;  // HBM bandwidth: elementwise ops are bound by it
  double kernel_latency_s = 0;    // per op (launch / dispatch)
  LinkSpec intra_node;            // NVLink / NVSwitch
  LinkSpec inter_node;            // per-GPU NIC (InfiniBand)
  // ZeRO-Offload (docs/simulator.md): the GPU's PCIe link to host memory, and the
  // node's CPUs that run the offloaded optimizer.
  double host_link_bytes_per_s = 0;      // per GPU, per direction (effective)
  int host_cores = 1;                    // CPU cores per node
  int64_t host_memory_bytes = 0;         // host memory per node
  double host_memory_bytes_per_s = 0;    // achievable host DRAM bandwidth per node (0: no cap)
  double cpu_adam_bytes_per_core_s = 0;  // fused AdamW bytes (28 per element) per second per core
  bool native_reduce_scatter = true;  // a reduce-scatter costs (n-1)/n of the bytes, not an all-reduce's 2(n-1)/n
  bool reduce_16bit_as_fp32 = false;  // all-reduces of 16-bit tensors move fp32 (the engine's CPU transports)
  std::optional<Calibration> calibration;  // cpu-local only
  // cpu-local: the share of the CPU time the ranks want that the host takes
  // (/proc/stat steal) during the predicted run; every time is / (1 - it).
  double host_steal_fraction = 0;

  double peak_flops(bool sixteen_bit) const { return sixteen_bit ? peak_flops_16bit : peak_flops_32bit; }
};

struct ClusterOptions {
  std::string calibration_file;          // cpu-local: default_calibration_path() when empty
  std::optional<double> inter_node_GBps; // override the per-GPU inter-node bandwidth (GB/s)
};

std::vector<std::string> cluster_names();
// The cpu-local cluster of a calibration (`file` names it in descriptions).
ClusterSpec cpu_local_cluster(Calibration calibration, const std::string& file);
// UserError listing the names when unknown; cpu-local without a calibration file
// is a UserError that says how to make one.
ClusterSpec find_cluster(const std::string& name, const ClusterOptions& options = {});

}  // namespace autotp::sim
