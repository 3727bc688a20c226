#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "autotp/data/data_tokenizer.h"
#include "autotp/data/dataset.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/run_phase.h"
#include "autotp/checkpoint/adapter_files.h"
#include "autotp/lora/lora_weights.h"
#include "autotp/checkpoint/checkpointing.h"
#include "autotp/runtime/trainer.h"
#include "autotp/base/json_file.h"
#include "autotp/runtime/hf_trainer_config.h"
#include "cli/cli.h"
#include "cli/hf_training_flags.h"
#include "cli/lora_flags.h"
#include "cli/malloc_policy.h"
#include "cli/sft_flags.h"
#include "launcher/restarts.h"

namespace autotp::cli {

namespace {

std::string format_duration(double seconds) {
  int s = static_cast<int>(std::lround(seconds));
  return s >= 3600 ? fmt::format("{}h{:02d}m", s / 3600, s / 60 % 60) : fmt::format("{}m{:02d}s", s / 60, s % 60);
}

// The step's metrics line: rank 0's metrics with every rank's memory (a
// collective: every rank calls it; only rank 0 gets the line, the others null).
nlohmann::json metrics_line(const StepMetrics& m, Trainer& trainer, Topology& topology, const TrainConfig& config,
                            int64_t seq_len) {
  auto mine = torch::tensor({m.model_states.params, m.model_states.grads, m.model_states.master_weights,
                             m.model_states.optimizer_states, m.peak_rss_bytes, m.peak_allocated_bytes,
                             m.activations_peak_bytes, m.peak_reserved_bytes, m.peak_gathered_params_bytes,
                             m.peak_gradient_buckets_bytes, m.model_states.frozen_params,
                             m.model_states.offload_buffers, m.model_states.host},
                            torch::kLong);
  auto all = topology.world().all_gather(mine.view({1, -1}), 0);
  if (topology.rank() != 0) return nullptr;
  nlohmann::json line = m.to_json();
  line["layout"] = {{"tp", topology.tp_size()}, {"dp", topology.dp_size()}, {"ep", topology.ep_size()},
                    {"zero_stage", config.zero.stage},
                    {"world", topology.world_size()}, {"dtype", hf_dtype_name(trainer.model().dtype())},
                    {"overlap_comm", config.zero.overlaps(trainer.model().device().is_cuda())},
                    {"sequence_parallel", trainer.model().plan().sequence_parallel()},
                    {"tp_overlap_comm", trainer.model().plan().overlap_comm()},
                    // What `autotp simulate --measured` needs to simulate the same step.
                    {"micro_batch", config.train_micro_batch_size_per_gpu},
                    {"gradient_accumulation_steps", config.gradient_accumulation_steps},
                    {"seq_len", seq_len},
                    {"recompute", config.activation_checkpointing.enabled && config.activation_checkpointing.layers.empty()
                                      ? config.activation_checkpointing.mode
                                      : config.activation_checkpointing.enabled ? "some layers" : "off"},
                    {"reduce_bucket_size", config.zero.reduce_bucket_size},
                    {"allgather_bucket_size", config.zero.allgather_bucket_size},
                    {"stage3_param_persistence_threshold", config.zero.stage3_param_persistence_threshold}};
  if (config.lora.enabled)
    line["layout"]["lora"] = {{"r", config.lora.r}, {"modules", adapted_modules(trainer.model()).size()}};
  const char* keys[] = {"params", "grads", "master_weights", "optimizer_states", "peak_rss_bytes",
                        "peak_allocated_bytes", "activations_peak_bytes", "peak_reserved_bytes",
                        "peak_gathered_params_bytes", "peak_gradient_buckets_bytes", "frozen_params",
                        "offload_buffers", "host_bytes"};
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < topology.world_size(); ++r) {
    nlohmann::json rank = {{"rank", r}};
    for (int k = 0; k < 10; ++k) rank[keys[k]] = all[r][k].item<int64_t>();
    // LoRA's base and ZeRO-Offload's host side: present where they exist.
    for (int k = 10; k < 13; ++k)
      if (const int64_t bytes = all[r][k].item<int64_t>(); bytes > 0) rank[keys[k]] = bytes;
    ranks.push_back(std::move(rank));
  }
  line["memory"]["ranks"] = ranks;
  return line;
}

// The progress line on stderr: rewritten in place on a terminal, every
// steps_per_print steps (and the first and last) otherwise.
void print_progress(const StepMetrics& m, const TrainConfig& config, int64_t steps, double eta_s, bool last) {
  std::string progress = fmt::format("step {}/{} loss {:.4f} grad_norm {:.3f} lr {:.3g} {:.0f} tok/s ETA {}", m.step,
                                     steps, m.loss, m.grad_norm, m.lr, m.tokens_per_s, format_duration(eta_s));
  if (config.wall_clock_breakdown)
    progress += fmt::format(" (forward+backward {:.3f}s, optimizer {:.3f}s)", m.forward_backward_s, m.optimizer_s);
  static const bool tty = isatty(STDERR_FILENO);
  if (tty)
    std::cerr << "\r" << progress << "\033[K" << (last ? "\n" : "") << std::flush;
  else if (m.step == 1 || last || m.step % config.steps_per_print == 0)
    std::cerr << progress << "\n";
}

struct TrainArgs {
  std::string config, model, data, metrics, bin_dtype = "uint16", tokenizer = "auto";
  std::string save, resume, export_hf, export_dtype, max_shard_size = "0";
  int64_t steps = 10, seq_len = 0, save_every = 0;
  bool no_shuffle = false;
  std::optional<uint64_t> seed;
  std::optional<int64_t> max_steps;  // HF's name of --steps
  std::optional<int> ep;             // expert_parallel.autoep_size (turns it on)
  CLI::Option* steps_option = nullptr;
  HfTrainingFlags hf;
  SftFlags sft;
  LoraFlags lora;
  WorldOptions world;
};

void add_train_options(CLI::App* cmd, TrainArgs* args) {
  cmd->add_option("--config,--deepspeed", args->config,
                  "DeepSpeed-style JSON config, HF-Trainer \"auto\" values included (see docs/config.md)")
      ->required();
  cmd->add_option("--model", args->model, "HF model directory or preset:NAME")->required();
  cmd->add_option("--data", args->data,
                  "Training data: .txt, .jsonl or .json records (text, instruction, chat), .json token arrays or .bin "
                  "(see docs/data.md)")
      ->required();
  args->steps_option =
      cmd->add_option("--steps", args->steps, "Train until this optimizer step (default 10; counts resumed steps too)")
          ->check(CLI::PositiveNumber);
  cmd->add_option("--max_steps,--max-steps", args->max_steps,
                  "HF's name of --steps; a scheduler total_num_steps number must equal it")
      ->check(CLI::PositiveNumber)
      ->excludes(args->steps_option);
  cmd->add_option("--ep", args->ep,
                  "Expert-parallel size of a mixture of experts (expert_parallel.autoep_size; divides world / tp, at "
                  "most the experts)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--save", args->save, "Checkpoint root: writes DIR/step_N/ and DIR/latest at the end (and every --save-every steps)");
  cmd->add_option("--save-every", args->save_every, "Also save every N steps (needs --save)")->check(CLI::PositiveNumber);
  cmd->add_option("--resume", args->resume,
                  "Continue from a checkpoint root (its latest) or a step_N directory, saved at any tp/dp/stage; "
                  "auto: from --save's latest when there is one, else from the start");
  cmd->add_option("--export-hf", args->export_hf, "At the end, write the consolidated HF model here");
  cmd->add_option("--export-dtype", args->export_dtype, "dtype of --export-hf: f32, bf16 or f16 (default: the training dtype)");
  cmd->add_option("--max-shard-size", args->max_shard_size, "Shard --export-hf above this size, e.g. 2GB (default: one file)");
  cmd->add_option("--seq-len", args->seq_len, "Tokens per example (required except for .json token arrays)");
  cmd->add_flag("--no-shuffle", args->no_shuffle, "Keep file order: step k trains on examples [k*GBS, (k+1)*GBS)");
  cmd->add_option("--metrics", args->metrics, "Write one JSON line per optimizer step here (rank 0)");
  cmd->add_option("--seed", args->seed, "Seed (overrides the config's seed; also seeds preset weights)");
  cmd->add_option("--bin-dtype", args->bin_dtype, "Token type of .bin data: uint16 or uint32 (default uint16)")
      ->check(CLI::IsMember({"uint16", "uint32"}));
  cmd->add_option("--tokenizer", args->tokenizer,
                  "Tokenizer of .txt/.jsonl data: auto (the model directory's own; byte-level for presets), "
                  "bytes, or a directory with tokenizer.json / tokenizer.model (default auto)");
  add_sft_flags(*cmd, args->sft);
  add_lora_flags(*cmd, args->lora, LoraFlagSet::kTrain);
  add_hf_training_flags(*cmd, args->hf);
  add_world_options(*cmd, args->world);
  add_restart_option(*cmd, args->world);
  add_device_options(*cmd, args->world);
}

// The config with its HF-Trainer "auto" values filled from the flags.
ResolvedTrainConfig resolve_config_file(const TrainArgs& args, const ModelSource& source, const DistEnv& env) {
  HfTrainingArguments hf = args.hf.resolved();
  if (args.max_steps || args.steps_option->count() > 0) hf.max_steps = args.steps;
  hf.max_steps_from_hf_flag = args.max_steps.has_value();
  HfResolveContext context;
  context.world_size = env.world_size;
  context.hidden_size = source.config.hidden_size;
  return resolve_hf_trainer_config(read_json_file(args.config, "config file"), hf, context, args.config);
}

// Rank 0 prints what was filled and writes resolved_config.json beside --metrics
// (else into --save); called once the model, the data and any checkpoint are loaded.
void publish_resolved_config(const TrainArgs& args, const ResolvedTrainConfig& resolved, const DistEnv& env) {
  if (env.rank != 0 || env.restart_count > 0) return;
  if (!resolved.filled.empty())
    log().info("{}: \"auto\" values filled as the HF Trainer fills them:\n  {}\nresolved config: {}", args.config,
               fmt::join(resolved.filled, "\n  "), resolved.config.dump());
  namespace fs = std::filesystem;
  fs::path dir;
  if (!args.metrics.empty())
    dir = fs::path(args.metrics).parent_path();
  else if (!args.save.empty())
    dir = fs::path(args.save);
  else
    return;
  if (dir.empty()) dir = ".";
  std::error_code error;
  fs::create_directories(dir, error);
  io::write_text_file_atomic((dir / "resolved_config.json").string(), resolved.config.dump(2) + "\n");
}

// True unless `latest` was written before this run's first attempt began
// (AUTOTP_RUN_START_NS, set by --max-restarts; without it, under torchrun, any counts).
bool written_by_this_run(const std::string& latest) {
  const char* start = std::getenv(launcher::kRunStartVariable);
  struct stat info {};
  if (start == nullptr || ::stat(latest.c_str(), &info) != 0) return true;
  const int64_t written_ns = static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec;
  return written_ns >= std::strtoll(start, nullptr, 10);
}

// Where this run resumes from ("" = the start): --resume, except that `auto` takes
// --save's newest complete checkpoint when there is one, and so does every restart
// of the world (--max-restarts, torchrun's) once this run has saved one.
std::string resume_source(const TrainArgs& args, const DistEnv& env) {
  const bool automatic = args.resume == "auto";
  AUTOTP_USER_CHECK(!automatic || !args.save.empty(), "--resume auto resumes from --save DIR: give --save too");
  const std::string latest = (std::filesystem::path(args.save) / "latest").string();
  const bool saved = !args.save.empty() && std::filesystem::exists(latest);
  if (saved && (automatic || (env.restart_count > 0 && written_by_this_run(latest)))) return args.save;
  return automatic ? "" : args.resume;
}

// On a resumed run the metrics file keeps the lines of the steps before the
// checkpoint (a restart drops those of the steps it repeats) and goes on after them.
void keep_metrics_until(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step)
      kept += line + "\n";
  }
  in.close();
  io::write_text_file_atomic(path, kept);
}

// The optimizer steps from the trainer's position to --steps: checkpoints every
// --save-every, one metrics line and a progress line per step. Returns the step
// last saved (-1: none).
int64_t run_steps(const TrainArgs& args, Trainer& trainer, Topology& topology, const TrainConfig& config,
                  const Dataset& data, const SaveOptions& save_options, int restarts) {
  retain_freed_memory();  // steps repeat the same allocations: reuse them instead of faulting pages in
  const int64_t first_step = trainer.steps_done();
  int64_t saved_at = -1;
  std::ofstream metrics;
  if (topology.rank() == 0 && !args.metrics.empty()) {
    if (first_step > 0) keep_metrics_until(args.metrics, first_step);
    metrics.open(args.metrics, first_step > 0 ? std::ios::app : std::ios::trunc);
    AUTOTP_USER_CHECK(metrics.good(), "--metrics {}: cannot open for writing", args.metrics);
  }
  double elapsed = 0;
  for (int64_t s = first_step; s < args.steps; ++s) {
    StepMetrics m = trainer.train_step();
    elapsed += m.step_time_s;
    if (args.save_every > 0 && m.step % args.save_every == 0) {
      save_checkpoint(trainer, args.save, save_options);
      saved_at = m.step;
    }
    // Every rank's memory goes into rank 0's line.
    nlohmann::json line = metrics_line(m, trainer, topology, config, data.seq_len());
    if (line.is_null()) continue;
    line["restarts"] = restarts;
    if (metrics.is_open()) metrics << line.dump() << "\n" << std::flush;
    const double eta = elapsed / static_cast<double>(s + 1 - first_step) * static_cast<double>(args.steps - s - 1);
    print_progress(m, config, args.steps, eta, s + 1 == args.steps);
  }
  return saved_at;
}

// What a LoRA run can and cannot do (docs/lora.md), before anything starts.
void check_lora_run(const TrainConfig& config, const TrainArgs& args) {
  const LoraConfig& lora = config.lora;
  AUTOTP_USER_CHECK(lora.enabled || (args.lora.save_adapter.empty() && !args.lora.merge_lora),
                    "--save-adapter and --merge-lora need LoRA (a lora section in the config, --lora-r or --adapter)");
  if (!lora.enabled) return;
  AUTOTP_USER_CHECK(args.export_hf.empty() || args.lora.merge_lora,
                    "--export-hf under LoRA writes the merged model: add --merge-lora (or write the adapter alone "
                    "with --save-adapter DIR)");
  AUTOTP_USER_CHECK(!args.lora.merge_lora || !args.export_hf.empty(), "--merge-lora needs --export-hf DIR");
}

// What expert parallelism does not do yet (docs/architecture.md "Expert parallelism"), before anything starts.
void check_expert_parallel_run(const TrainConfig& config) {
  if (config.expert_parallel.size() == 1) return;
  AUTOTP_USER_CHECK(!config.lora.enabled,
                    "expert_parallel.autoep_size {} with LoRA is not supported yet (allowed: autoep_size 1 with a lora "
                    "section, or no lora section)",
                    config.expert_parallel.autoep_size);
}

void run_train(const TrainArgs& args) {
  // Everything that can be checked without the others is checked before the rendezvous.
  DistEnv env = DistEnv::from_environment();
  auto source = resolve_model(args.model);
  const ResolvedTrainConfig resolved = resolve_config_file(args, source, env);
  auto config = TrainConfig::from_json(resolved.config, args.config);
  if (args.seed) config.seed = *args.seed;
  config.resolve_batch(env.world_size);
  config.lora = resolve_lora(config.lora, args.lora);
  check_lora_run(config, args);
  if (args.ep) config.expert_parallel.enabled = true, config.expert_parallel.autoep_size = *args.ep;
  const int tp = config.tensor_parallel.autotp_size, ep = config.expert_parallel.size();
  config.expert_parallel.validate(source.config, env.world_size, tp);
  check_expert_parallel_run(config);
  const ExpertPlacement experts{ep, Topology::coordinates(env.rank, tp).dp_rank % ep, source.config.num_experts};
  auto plan = place_experts(
      apply_lora_plan(TpPlan::build(source.config, config.tensor_parallel.plan_options()), config.lora), experts);
  std::shared_ptr<Dataset> data =
      open_dataset(args.data, data_options(source, args.data, args.seq_len, args.bin_dtype, args.tokenizer, args.sft));
  AUTOTP_USER_CHECK(args.save_every == 0 || !args.save.empty(), "--save-every needs --save DIR");
  {
    std::error_code error;
    AUTOTP_USER_CHECK(args.export_hf.empty() || !source.dir || !std::filesystem::equivalent(args.export_hf, *source.dir, error),
                      "--export-hf {} is the --model directory: an export would replace the model it trains from; "
                      "choose another directory",
                      args.export_hf);
  }
  ExportOptions export_options;
  if (!args.export_dtype.empty()) export_options.dtype = parse_dtype(args.export_dtype);
  export_options.max_shard_bytes = io::parse_byte_size(args.max_shard_size);
  export_options.model_files_dir = source.dir.value_or("");
  std::optional<io::SavedCheckpoint> resume;
  const std::string resume_from = resume_source(args, env);
  if (!resume_from.empty()) resume = io::SavedCheckpoint::open(resume_from);  // bad paths fail before the rendezvous

  const Placement placement = place_rank(args.world, config.device);
  const torch::ScalarType dtype = training_dtype(config);
  auto topology = join_world(args.world, tp, placement.backend, ep);
  torch::manual_seed(config.seed);
  publish_phase("load");  // a rank that dies building its model is named as such, not as in the rendezvous
  auto model = load_model(source, plan, topology->tp(), dtype, config.seed, nullptr, placement.device);
  if (ep > 1) model->set_expert_parallel(experts, topology->ep());
  prepare_lora_model(*model, config.lora, args.lora, config.seed);
  log().info("model {} ({}) on {}, data {}", source.label, source.config.architecture, placement.device.str(),
             data->describe());
  log().info("layout: world {} = dp {} x tp {}{}, ZeRO stage {}, micro-batch {}, gradient accumulation {}, global batch {}",
             topology->world_size(), topology->dp_size(), topology->tp_size(),
             ep > 1 ? fmt::format(" (experts: ep {} x edp {}, {} experts per rank)", ep, topology->edp_size(),
                                  experts.per_rank())
                    : "",
             config.zero.stage,
             config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps, config.train_batch_size);
  Trainer trainer(config, topology, std::move(model), data, !args.no_shuffle);
  if (resume) load_checkpoint(trainer, *resume);
  publish_resolved_config(args, resolved, env);  // the model, data and any checkpoint are in place
  if (env.restart_count > 0)
    log().warn("restart {} of this run: {}", env.restart_count,
               resume ? fmt::format("resumed at step {} from {}", trainer.steps_done(), resume_from)
                      : std::string("no checkpoint under --save yet, started from the beginning"));
  const int64_t first_step = trainer.steps_done();
  if (first_step >= args.steps)
    log().warn("the checkpoint is at step {}, --steps is {}: nothing to train (--steps counts every step of the run)",
               first_step, args.steps);
  SaveOptions save_options;
  save_options.gather_16bit_weights = config.zero.gather_16bit_weights_on_model_save;
  save_options.model_files_dir = source.dir.value_or("");
  const int64_t saved_at = run_steps(args, trainer, *topology, config, *data, save_options, env.restart_count);

  if (!args.save.empty() && saved_at != trainer.steps_done()) save_checkpoint(trainer, args.save, save_options);
  if (!args.lora.save_adapter.empty())
    save_adapter(trainer, config.lora, args.lora.save_adapter, source.dir.value_or(source.label));
  if (!args.export_hf.empty()) export_hf(trainer, args.export_hf, export_options);
  publish_phase("done", trainer.steps_done());
  topology->world().barrier();  // rank 0 hosts the store: leave together
}

}  // namespace

void register_train(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a model with AutoTP + ZeRO from a DeepSpeed-style JSON config");
  add_train_options(cmd, args.get());
  cmd->callback([args] {
    if (args->max_steps) args->steps = *args->max_steps;
    if (!run_as_rank(args->world)) return;
    run_train(*args);
  });
}

}  // namespace autotp::cli
