#include "simulator/cluster_catalog.h"

#include <fmt/ranges.h>
#include <sys/stat.h>

#include "autotp/base/error.h"

namespace autotp::sim {
namespace {

constexpr double kGB = 1e9;
constexpr int64_t kGiB = int64_t{1} << 30;

// Achievable fraction of the datasheet link bandwidth for large all-reduces
// (nccl-tests bus bandwidth on DGX systems lands around 75-85% of NVLink's
// unidirectional figure): an assumption, stated in docs/simulator.md.
constexpr double kLinkEfficiency = 0.8;

// Achievable fraction of a node's datasheet DRAM bandwidth for a streaming
// kernel such as the fused AdamW (STREAM-like): an assumption, stated in docs/simulator.md.
constexpr double kHostMemoryEfficiency = 0.7;

// The host side of a GPU node (ZeRO-Offload): PCIe link per GPU, CPU cores,
// memory and DRAM bandwidth per node.
struct HostSpec {
  double pcie_effective = 0;  // per GPU, per direction
  int cores = 1;
  int64_t memory = 0;
  double dram_peak = 0;  // datasheet channels x transfer rate, all sockets
};

ClusterSpec gpu_node(std::string name, std::string description, std::string sources, int64_t memory,
                     double bf16, double fp32, double hbm, double nvlink_unidirectional, double nic,
                     const HostSpec& host) {
  ClusterSpec c;
  c.name = std::move(name);
  c.description = std::move(description);
  c.sources = std::move(sources);
  c.gpus_per_node = 8;
  c.memory_bytes = memory;
  c.reserved_bytes = 2 * kGiB;
  c.peak_flops_16bit = bf16;
  c.peak_flops_32bit = fp32;
  c.gemm_efficiency = 0.7;
  c.assumptions = fmt::format(
      "assumed, not measured on this cluster: GEMMs at {:.0f}% of peak, collectives at {:.0f}% of the link's "
      "bandwidth (step times scale with them)",
      100 * c.gemm_efficiency, 100 * kLinkEfficiency);
  c.memory_bytes_per_s = hbm;
  c.kernel_latency_s = 5e-6;
  c.intra_node = {10e-6, kLinkEfficiency * nvlink_unidirectional};
  c.inter_node = {20e-6, kLinkEfficiency * nic};
  c.host_link_bytes_per_s = host.pcie_effective;
  c.host_cores = host.cores;
  c.host_memory_bytes = host.memory;
  c.host_memory_bytes_per_s = kHostMemoryEfficiency * host.dram_peak;
  c.cpu_adam_bytes_per_core_s = kDefaultCpuAdamBytesPerCoreS;
  return c;
}

std::vector<ClusterSpec> gpu_clusters() {
  // PCIe per direction: Gen3 x16 16 GB/s, Gen4 x16 32 GB/s, Gen5 x16 64 GB/s raw
  // (PCI-SIG); effective host-copy rates about 12, 25 and 50 GB/s (pinned memory).
  const HostSpec dgx_a100{25 * kGB, 128, 2048 * kGiB, 2 * 8 * 25.6 * kGB};  // 2x EPYC 7742, 16x DDR4-3200
  const HostSpec dgx_h100{50 * kGB, 112, 2048 * kGiB, 2 * 8 * 38.4 * kGB};  // 2x Xeon 8480C, 16x DDR5-4800
  const std::string a100_host =
      "; DGX A100 host: 2x AMD EPYC 7742 (128 cores), 2 TB DDR4-3200 in 16 channels (409.6 GB/s), PCIe Gen4 x16 "
      "per GPU (32 GB/s per direction, ~25 GB/s effective)";
  const std::string h100_host =
      " host: 2x Intel Xeon Platinum 8480C (112 cores), 2 TB DDR5-4800 in 16 channels (614.4 GB/s), PCIe Gen5 x16 "
      "per GPU (64 GB/s per direction, ~50 GB/s effective)";
  std::vector<ClusterSpec> list = {
      gpu_node("8xA100-80GB", "8x A100 SXM4 80GB, NVLink 3 / NVSwitch, 8x 200 Gb/s HDR InfiniBand per node",
               "NVIDIA A100 datasheet (312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32, 2039 GB/s HBM2e, NVLink 600 GB/s "
               "bidirectional); DGX A100 user guide (8x ConnectX-6 HDR 200 Gb/s" + a100_host + ")",
               80 * kGiB, 312e12, 19.5e12, 2039 * kGB, 300 * kGB, 25 * kGB, dgx_a100),
      gpu_node("8xH100-80GB", "8x H100 SXM5 80GB, NVLink 4 / NVSwitch, 8x 400 Gb/s NDR InfiniBand per node",
               "NVIDIA H100 datasheet (989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 3.35 TB/s HBM3, NVLink 900 GB/s "
               "bidirectional); DGX H100 user guide (8x ConnectX-7 NDR 400 Gb/s;" + h100_host + ")",
               80 * kGiB, 989e12, 67e12, 3350 * kGB, 450 * kGB, 50 * kGB, dgx_h100),
      gpu_node("8xH200-141GB", "8x H200 SXM 141GB, NVLink 4 / NVSwitch, 8x 400 Gb/s NDR InfiniBand per node",
               "NVIDIA H200 datasheet (989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 141 GB HBM3e at 4.8 TB/s, NVLink "
               "900 GB/s bidirectional); DGX H200 user guide (8x ConnectX-7 NDR 400 Gb/s;" + h100_host + ")",
               141000000000, 989e12, 67e12, 4800 * kGB, 450 * kGB, 50 * kGB, dgx_h100),
      // The ZeRO-Offload paper's machine (Ren et al., arXiv:2101.06840): a DGX-2. V100
      // has no bf16: simulate it with --dtype fp16.
      gpu_node("16xV100-32GB", "16x V100 SXM3 32GB, NVLink 2 / NVSwitch, 8x 100 Gb/s EDR InfiniBand per node",
               "NVIDIA V100 datasheet (125 TFLOP/s FP16 tensor, 15.7 TFLOP/s FP32, 900 GB/s HBM2, NVLink 300 GB/s "
               "bidirectional); DGX-2 datasheet (8x 100 Gb/s EDR for 16 GPUs; host: 2x Intel Xeon Platinum 8168 "
               "(48 cores), 1.5 TB DDR4-2666 in 12 channels (256 GB/s), PCIe Gen3 x16 per GPU (16 GB/s per direction, "
               "~12 GB/s effective))",
               32 * kGiB, 125e12, 15.7e12, 900 * kGB, 150 * kGB, 6.25 * kGB,
               HostSpec{12 * kGB, 48, 1536 * kGiB, 2 * 6 * 21.33 * kGB}),
  };
  list.back().gpus_per_node = 16;
  return list;
}

bool exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

}  // namespace

ClusterSpec cpu_local_cluster(Calibration cal, const std::string& file) {
  ClusterSpec c;
  c.name = "cpu-local";
  c.description = fmt::format("this machine: {} cores, calibrated with {} ranks x {} threads ({})", cal.cores,
                              cal.world, cal.threads_per_rank, file);
  c.sources = "measured by `autotp simulate --calibrate` (" + file + ")";
  c.gpus_per_node = cal.world;
  c.memory_bytes = cal.memory_bytes / std::max(1, cal.world);
  c.reserved_bytes = 0;
  c.peak_flops_32bit = cal.costs_for("fp32").gemm_peak_flops;
  c.peak_flops_16bit = cal.costs_for("bf16").gemm_peak_flops;
  c.gemm_efficiency = 1;
  c.memory_bytes_per_s = cal.compute.elementwise_forward.rate;
  c.kernel_latency_s = cal.compute.elementwise_forward.latency_s;
  // The engine's CPU transports run a real reduce-scatter (each rank sums only its
  // slice, 16-bit values travel as they are); an all-reduce of 16-bit tensors is
  // summed in fp32 and so moves 4 bytes an element (comm.cpp). NCCL reduces them natively.
  c.native_reduce_scatter = true;
  c.reduce_16bit_as_fp32 = cal.device != "cuda";
  // ZeRO-Offload on a CPU device: "host" and "device" are the same memory, a copy
  // runs at the elementwise rate, the optimizer on each rank's own threads.
  c.host_link_bytes_per_s = cal.compute.elementwise_forward.rate;
  c.host_cores = cal.threads_per_rank * std::max(1, cal.world);
  c.host_memory_bytes = cal.memory_bytes;
  c.host_memory_bytes_per_s = 0;
  c.cpu_adam_bytes_per_core_s = cal.cpu_adam_bytes_per_core_s.value_or(kDefaultCpuAdamBytesPerCoreS);
  c.calibration = std::move(cal);
  return c;
}

namespace {
ClusterSpec cpu_local(const std::string& file) {
  AUTOTP_USER_CHECK(exists(file),
                    "cluster cpu-local needs a calibration file, {} does not exist (make one with "
                    "`autotp simulate --calibrate --nproc N --calibration {}`)",
                    file, file);
  return cpu_local_cluster(Calibration::from_file(file), file);
}
}  // namespace

std::vector<std::string> cluster_names() {
  std::vector<std::string> names;
  for (const auto& c : gpu_clusters()) names.push_back(c.name);
  names.push_back("cpu-local");
  return names;
}

ClusterSpec find_cluster(const std::string& name, const ClusterOptions& options) {
  if (name == "cpu-local")
    return cpu_local(options.calibration_file.empty() ? default_calibration_path() : options.calibration_file);
  for (auto& c : gpu_clusters()) {
    if (c.name != name) continue;
    if (options.inter_node_GBps) {
      AUTOTP_USER_CHECK(*options.inter_node_GBps > 0, "--inter-node-bw must be positive, got {}",
                        *options.inter_node_GBps);
      c.inter_node.bus_bytes_per_s = kLinkEfficiency * *options.inter_node_GBps * kGB;
    }
    return c;
  }
  throw_user_error("--cluster {}: unknown cluster (allowed: {})", name, fmt::join(cluster_names(), ", "));
}

}  // namespace autotp::sim
