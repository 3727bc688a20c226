#include "cli/cli.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <csignal>
#include <cstdlib>
#include <string>
#include <iostream>

#include "autotp/base/bf16_matmul.h"
#include "autotp/comm/dist_env.h"
#include "autotp/base/device.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/memory_counter.h"
#include "autotp/base/run_phase.h"
#include "cli/blas_threads.h"
#include "launcher/launcher.h"
#include "launcher/restarts.h"

namespace autotp::cli {
namespace {
std::vector<std::string> g_argv;  // the original command line, re-run by maybe_launch
}

void add_world_options(CLI::App& command, WorldOptions& options) {
  command.add_option("--nproc", options.nproc, "Local ranks to start (default 1; ignored when RANK/WORLD_SIZE are set)")
      ->check(CLI::PositiveNumber);
  command.add_option("--threads", options.threads, "Torch/BLAS threads per rank (default: cores / local ranks)")
      ->check(CLI::NonNegativeNumber);
  command.add_option("--timeout", options.timeout_s, "Collective and rendezvous timeout in seconds (default 300)")
      ->check(CLI::PositiveNumber);
}

void add_restart_option(CLI::App& command, WorldOptions& options) {
  command.add_option("--max-restarts", options.max_restarts,
                     "When a rank fails, stop the others and start the whole world again, at most N times, "
                     "resuming from the newest complete checkpoint under --save (default 0)")
      ->check(CLI::NonNegativeNumber);
}

void add_device_options(CLI::App& command, WorldOptions& options) {
  command.add_option("--device", options.device,
                     "cpu, cuda or auto (default: the config's \"device\", else auto = cuda when every local rank "
                     "has a GPU of its own)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  command.add_option("--backend", options.backend,
                     "Collectives of CUDA tensors: nccl (one rank per GPU) or gloo (ranks may share a GPU); "
                     "default nccl on cuda. CPU tensors always use Gloo")
      ->check(CLI::IsMember({"gloo", "nccl"}));
}

Placement place_rank(const WorldOptions& options, const std::string& config_device) {
  DistEnv env = DistEnv::from_environment();
  const DeviceKind kind = parse_device(options.device.empty() ? config_device : options.device);
  Backend backend = options.backend.empty() ? Backend::kNccl : parse_backend(options.backend);
  const bool shared = backend == Backend::kGloo;
  Placement placement;
  placement.device = bind_device(kind, env.local_rank, env.local_world_size, shared);
  placement.backend = placement.device.is_cuda() ? backend : Backend::kGloo;
  AUTOTP_USER_CHECK(placement.device.is_cuda() || options.backend != "nccl",
                    "--backend nccl needs device cuda (NCCL moves CUDA tensors only); this rank runs on cpu");
  return placement;
}

int maybe_launch(const WorldOptions& options) {
  if ((options.nproc <= 1 && options.max_restarts == 0) || launcher::in_distributed_world()) return -1;
  launcher::LaunchOptions launch;
  launch.nproc = options.nproc;
  launch.argv = g_argv;
  launch.argv[0] = launcher::self_executable();
  launch.threads_per_rank = options.threads;
  const auto restarted = launcher::launch_with_restarts(launch, options.max_restarts, [&](int n, const auto& failed) {
    std::cerr << "autotp: " << failed.summary << "\n"
              << fmt::format("autotp: restarting all {} ranks (restart {} of {})", options.nproc, n,
                             options.max_restarts)
              << std::endl;
  });
  const launcher::LaunchResult& result = restarted.last;
  if (result.exit_code != 0) {
    std::cerr << "autotp: " << result.summary << std::endl;
    if (restarted.restarts > 0)
      std::cerr << fmt::format("autotp: gave up after {} restart{}", restarted.restarts,
                               restarted.restarts == 1 ? "" : "s")
                << std::endl;
  }
  if (result.exit_code == 0 && result.peak_resident_bytes > 0)
    std::cerr << fmt::format(
        "autotp: peak resident memory of the launcher and {} ranks together: {:.2f} GiB (proportional set "
        "sizes: pages they share counted once)\n",
        options.nproc, result.peak_resident_bytes / 1073741824.0);
  return result.exit_code;
}

std::shared_ptr<Topology> join_world(const WorldOptions& options, int tp_size, Backend backend, int ep_size) {
  DistEnv env = DistEnv::from_environment();
  init_logging(LogOptions{env.rank});
  if (const auto fault = armed_test_fault()) log().warn("{} is armed: {}", kTestFaultVariable, *fault);
  int threads = options.threads > 0 ? options.threads : env.threads;
  if (threads > 0) at::set_num_threads(threads);
  set_blas_threads(threads);
  TopologyOptions topo;
  topo.tp_size = tp_size;
  topo.ep_size = ep_size;
  topo.backend = backend;
  topo.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_s * 1000));
  if (env.world_size == 1) {
    AUTOTP_USER_CHECK(tp_size == 1, "autotp_size {} does not fit a world of 1 process (use --nproc {})", tp_size,
                      tp_size);
    return Topology::single();
  }
  publish_phase("rendezvous");
  return Topology::create(env, topo);
}

int run(int argc, char** argv) {
  // Before any tensor exists, so every byte is counted. AUTOTP_MEMORY_COUNTER=0
  // leaves LibTorch's allocator in place: only to measure what the counting costs
  // (bench/README.md); CPU peaks then read 0.
  if (const char* counter = std::getenv("AUTOTP_MEMORY_COUNTER"); !counter || std::string(counter) != "0")
    install_memory_counter();
  // Over a file-size limit (RLIMIT_FSIZE) a write fails with EFBIG and the error
  // names the file; the default action of SIGXFSZ would kill the rank without a word.
  signal(SIGXFSZ, SIG_IGN);
  // A peer that died closes its sockets: a write to one is an error, not a silent death by SIGPIPE.
  signal(SIGPIPE, SIG_IGN);
  g_argv.assign(argv, argv + argc);
  CLI::App app{"autotp: automatic tensor parallelism + ZeRO training for HF causal language models"};
  app.require_subcommand(1);
  register_presets(app);
  register_init(app);
  register_eval(app);
  register_plan(app);
  register_train(app);
  register_export(app);
  register_reshard(app);
  register_scenario(app);
  register_bench_comm(app);
  register_bench_step(app);
  register_bench_compare(app);
  register_simulate(app);
  register_tokenize(app);
  register_data(app);
  try {
    armed_test_fault();  // a bad AUTOTP_TEST_FAULT is exit 2 here, before any rank starts
    cpu_bf16_gemm();     // and a bad AUTOTP_CPU_BF16_GEMM, whatever the run's dtype
    publish_phase("startup");
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a launched run's exit code, already reported
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  } catch (const UserError& e) {
    std::cerr << "autotp: error: " << e.what() << std::endl;
    launcher::record_rank_failure(e.what(), 2);
    return 2;
  } catch (const NonFiniteError& e) {
    std::cerr << "autotp: error: " << e.what() << std::endl;
    launcher::record_rank_failure(e.what(), 3);
    return 3;
  } catch (const std::exception& e) {
    std::cerr << "autotp: error: " << e.what() << std::endl;
    launcher::record_rank_failure(e.what());
    return 1;
  }
  return 0;
}

}  // namespace autotp::cli
