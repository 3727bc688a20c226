#include <fmt/format.h>

#include <cmath>
#include <iostream>

#include "autotp/data/token_sequences.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "cli/cli.h"
#include "cli/lora_flags.h"

namespace autotp::cli {

void register_eval(CLI::App& app) {
  struct Args {
    std::string model, tokens, out, logits, dtype = "f32";
    int tp = 0;
    bool sequence_parallel = false;
    uint64_t seed = 0;
    LoraFlags lora;
    WorldOptions world;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("eval", "Evaluate the next-token loss of a model on token sequences");
  cmd->add_option("--model", args->model, "HF model directory or preset:NAME")->required();
  cmd->add_option("--tokens", args->tokens, "JSON file: array of equal-length arrays of token ids")->required();
  cmd->add_option("--out", args->out, "RESULT.json to write: loss, tokens, perplexity")->required();
  cmd->add_option("--logits", args->logits, "Also write logits [batch, seq-1, vocab] (float32) to this safetensors file");
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (default: the world size)")->check(CLI::PositiveNumber);
  cmd->add_flag("--sequence-parallel", args->sequence_parallel,
                "Norms and residuals on 1/tp of the sequence (tensor_parallel.sequence_parallel)");
  cmd->add_option("--dtype", args->dtype, "Compute dtype: f32 or bf16 (default f32)");
  cmd->add_option("--seed", args->seed, "Seed of a preset's random weights (default 0)");
  add_lora_flags(*cmd, args->lora, LoraFlagSet::kEval);
  add_world_options(*cmd, args->world);
  add_device_options(*cmd, args->world);
  cmd->callback([args] {
    if (!run_as_rank(args->world)) return;
    auto source = resolve_model(args->model);
    auto dtype = parse_dtype(args->dtype);
    // Validate inputs before any rendezvous so bad input fails fast on every rank.
    auto sequences = read_token_sequences(args->tokens, source.config.vocab_size);
    DistEnv env = DistEnv::from_environment();
    int tp = args->tp > 0 ? args->tp : env.world_size;
    AUTOTP_USER_CHECK(tp == env.world_size,
                      "eval runs one tensor-parallel group: --tp {} must equal the world size {}", tp,
                      env.world_size);
    TpPlanOptions plan_options;
    plan_options.tp_size = tp;
    plan_options.sequence_parallel = args->sequence_parallel;
    const LoraConfig lora = resolve_lora(LoraConfig{}, args->lora);  // --adapter, else off
    auto plan = apply_lora_plan(TpPlan::build(source.config, plan_options), lora);
    const Placement placement = place_rank(args->world);
    auto topology = join_world(args->world, tp, placement.backend);
    LoadReport load;
    auto model = load_model(source, plan, topology->tp(), dtype, args->seed, &load, placement.device);
    prepare_lora_model(*model, lora, args->lora, args->seed);
    if (source.dir)
      log().info("loaded {}: read {:.1f} MiB on this rank, peak RSS {:.1f} MiB", source.label,
                 load.bytes_read / 1048576.0, load.peak_rss_bytes / 1048576.0);

    torch::NoGradGuard no_grad;
    const int64_t L = sequences.size(1);
    auto inputs = sequences.narrow(1, 0, L - 1).contiguous();
    auto targets = sequences.narrow(1, 1, L - 1).contiguous();
    auto local_logits = model->forward(inputs);
    auto losses = model->losses_from_logits(local_logits, targets).to(torch::kFloat64);
    double total = losses.sum().item<double>();
    int64_t count = targets.numel();
    double loss = total / static_cast<double>(count);
    torch::Tensor logits;
    if (!args->logits.empty()) logits = model->gather_logits(local_logits).to(torch::kFloat32);
    if (topology->rank() == 0) {
      nlohmann::json result = {{"loss", loss}, {"tokens", count}, {"perplexity", std::exp(loss)},
                               {"tp", tp}, {"model", source.label}};
      io::write_text_file_atomic(args->out, result.dump(2) + "\n");
      if (logits.defined()) io::write_safetensors(args->logits, {{"logits", logits.contiguous()}});
      std::cout << fmt::format("loss {:.6f} over {} tokens (perplexity {:.3f}) -> {}\n", loss, count,
                               std::exp(loss), args->out);
    }
    topology->world().barrier();  // rank 0 hosts the store: leave together
  });
}

}  // namespace autotp::cli
