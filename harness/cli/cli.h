// The `autotp` command line: subcommands registered on one CLI11 app.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autotp/comm/topology.h"

namespace autotp::cli {

int run(int argc, char** argv);

// Options every distributed subcommand accepts.
struct WorldOptions {
  int nproc = 1;            // local ranks to spawn (ignored inside an existing world)
  int threads = 0;          // torch/BLAS threads per rank (0 = cores / local ranks)
  double timeout_s = 300;   // collective and rendezvous timeout
  std::string device;       // --device cpu|cuda|auto ("" = the config's, else auto)
  std::string backend;      // --backend gloo|nccl ("" = nccl for CUDA tensors, gloo for CPU)
  int max_restarts = 0;     // --max-restarts: start the world again after a rank fails (train)
};
void add_world_options(CLI::App& command, WorldOptions& options);
// --max-restarts, for the commands that can resume (train).
void add_restart_option(CLI::App& command, WorldOptions& options);
// --device and --backend, for the subcommands that compute (train, eval, bench-step).
void add_device_options(CLI::App& command, WorldOptions& options);

// Where this rank computes and which backend its groups use: --device (else
// `config_device`), CUDA bound to GPU LOCAL_RANK (see bind_device). Call before join_world.
struct Placement {
  torch::Device device = torch::kCPU;
  Backend backend = Backend::kGloo;
};
Placement place_rank(const WorldOptions& options, const std::string& config_device = "auto");

// When --nproc > 1 (or --max-restarts > 0) and this process is not already a rank
// of a world, re-runs this command as nproc local ranks (again after a failure,
// up to --max-restarts times) and returns their exit code; otherwise returns -1
// and the caller proceeds as a rank.
int maybe_launch(const WorldOptions& options);

// Ends a subcommand with a non-zero exit code (used after a launched run failed).
[[noreturn]] inline void exit_with(int code) { throw CLI::RuntimeError(code); }

// The start of every multi-rank command: true when this process is a rank and
// goes on; false when it launched the ranks and they all succeeded; a failed
// launch ends the command with their exit code.
inline bool run_as_rank(const WorldOptions& options) {
  const int launched = maybe_launch(options);
  if (launched > 0) exit_with(launched);
  return launched < 0;
}

// Sets up logging and threads for this rank and creates the topology.
std::shared_ptr<Topology> join_world(const WorldOptions& options, int tp_size, Backend backend = Backend::kGloo,
                                     int ep_size = 1);

// Subcommands.
void register_presets(CLI::App& app);
void register_init(CLI::App& app);
void register_eval(CLI::App& app);
void register_plan(CLI::App& app);
void register_train(CLI::App& app);
void register_export(CLI::App& app);
void register_reshard(CLI::App& app);
void register_scenario(CLI::App& app);
void register_bench_comm(CLI::App& app);
void register_bench_step(CLI::App& app);
void register_bench_compare(CLI::App& app);
void register_simulate(CLI::App& app);
void register_tokenize(CLI::App& app);
void register_data(CLI::App& app);

}  // namespace autotp::cli
