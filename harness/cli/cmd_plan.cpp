#include <fmt/format.h>

#include <fstream>
#include <iostream>

#include "autotp/model/presets.h"
#include "autotp/tp/expert_parallel.h"
#include "autotp/base/error.h"
#include "autotp/base/json_file.h"
#include "cli/cli.h"
#include "cli/lora_flags.h"

namespace autotp::cli {

void register_plan(CLI::App& app) {
  struct Args {
    std::string model, config, rules = "auto";
    int tp = 1, ep = 1;
    bool sequence_parallel = false;
    LoraFlags lora;
  };
  auto args = std::make_shared<Args>();
  auto* cmd = app.add_subcommand("plan", "Print the tensor-parallel plan of a model: roles and shard shapes per rank");
  cmd->add_option("--model", args->model, "HF model directory or preset:NAME")->required();
  cmd->add_option("--tp", args->tp, "Tensor-parallel size (default 1)")->check(CLI::PositiveNumber);
  cmd->add_option("--ep", args->ep,
                  "Expert-parallel size: which ep rank holds which experts, with their shapes (a mixture of experts)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--sequence-parallel", args->sequence_parallel,
                "Sequence parallelism: marks the gradients it makes partial (tensor_parallel.sequence_parallel)");
  cmd->add_option("--config", args->config,
                  "DeepSpeed-style JSON config; its tensor_parallel.partition_config user patterns and "
                  "sequence_parallel apply");
  cmd->add_option("--rules", args->rules, "auto | structural | names (default auto)")
      ->check(CLI::IsMember({"auto", "structural", "names"}));
  add_lora_flags(*cmd, args->lora, LoraFlagSet::kPlan);
  cmd->callback([args] {
    auto source = resolve_model(args->model);
    TpPlanOptions options;
    options.tp_size = args->tp;
    options.rules = args->rules == "structural" ? PlanRules::kStructural
                    : args->rules == "names"    ? PlanRules::kNames
                                                : PlanRules::kAuto;
    LoraConfig lora;
    if (!args->config.empty()) {
      nlohmann::json j = read_json_file(args->config, "config file");
      if (j.contains("lora")) {
        const nlohmann::json only = {{"lora", j["lora"]}};
        lora = LoraConfig::read(JsonSection(only, "", args->config, {"lora"}));
      }
      if (j.contains("tensor_parallel") && j["tensor_parallel"].contains("partition_config"))
        options.layer_specs = parse_partition_config(j["tensor_parallel"]["partition_config"]);
      if (j.contains("tensor_parallel") && j["tensor_parallel"].value("sequence_parallel", false))
        options.sequence_parallel = true;
    }
    if (args->sequence_parallel) options.sequence_parallel = true;
    lora = resolve_lora(lora, args->lora);
    auto plan = apply_lora_plan(TpPlan::build(source.config, options), lora);
    std::cout << fmt::format("{} ({}), tp = {}{}\n", source.label, source.config.architecture, args->tp,
                             plan.sequence_parallel() ? ", sequence parallel" : "");
    std::cout << plan.table();
    if (args->ep > 1) {
      ExpertParallelConfig ep;
      ep.enabled = true;
      ep.autoep_size = args->ep;
      ep.validate(source.config, args->ep * args->tp, args->tp);  // the smallest world that fits
      std::cout << expert_placement_table(plan, source.config, args->ep);
    }
  });
}

}  // namespace autotp::cli
