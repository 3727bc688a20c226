#include "autotp/checkpoint/adapter_files.h"

#include <filesystem>
#include <map>

#include "autotp/base/text.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/io/hf_writer.h"
#include "autotp/io/safetensors.h"
#include "autotp/lora/lora_weights.h"
#include "autotp/tp/parallel_layers.h"

namespace autotp {
namespace {

namespace fs = std::filesystem;

}  // namespace

void save_adapter(Trainer& trainer, const LoraConfig& lora, const std::string& dir, const std::string& base_model) {
  torch::NoGradGuard no_grad;
  auto& topo = trainer.topology();
  auto& model = trainer.model();
  {
    // Every rank (one filesystem): a failure is every rank's UserError, before any collective.
    std::error_code error;
    fs::create_directories(dir, error);
    AUTOTP_USER_CHECK(!error, "--save-adapter {}: cannot create the directory: {}", dir, error.message());
  }
  trainer.optimizer().gather_all_params(/*frozen=*/false);  // stage 3: what trains whole on its tp rank
  io::NamedTensors tensors;
  for (auto& p : model.parameters()) {
    if (!p.trains() || topo.dp_rank() != 0) continue;  // dp group 0's tp group gathers for rank 0
    torch::Tensor full = gather_full(p.spec(), p.tensor.detach(), topo.tp());
    if (topo.rank() == 0) tensors.emplace_back(peft_key(model, p.name()), full.to(torch::kFloat32).cpu().contiguous());
  }
  if (topo.rank() == 0) {
    io::write_safetensors((fs::path(dir) / kAdapterWeightsFile).string(), tensors, {{"format", "pt"}});
    const nlohmann::json config = lora.to_adapter_config(adapted_modules(model), base_model);
    io::write_text_file_atomic((fs::path(dir) / kAdapterConfigFile).string(), config.dump(2) + "\n");
    log().info("saved the LoRA adapter to {} ({} tensors)", dir, tensors.size());
  }
  topo.world().barrier();
}

void export_merged_hf(Trainer& trainer, const std::string& dir, const ExportOptions& options) {
  torch::NoGradGuard no_grad;
  auto& topo = trainer.topology();
  auto& model = trainer.model();
  trainer.optimizer().gather_all_params();
  std::map<std::string, const Parameter*> by_name;
  std::vector<std::pair<std::string, std::vector<int64_t>>> list;
  for (auto& p : model.parameters()) {
    by_name[p.name()] = &p;
    if (!p.entry->adapter) list.emplace_back(p.name(), p.entry->desc.shape);
  }
  std::unique_ptr<io::HfModelWriter> writer;
  const torch::ScalarType dtype = options.dtype.value_or(model.dtype());
  if (topo.rank() == 0) {
    writer = std::make_unique<io::HfModelWriter>(dir, model.config().raw, list, dtype, options.max_shard_bytes);
    writer->copy_companions_from(options.model_files_dir);
  }
  const double scaling = model.adapter_scaling();
  for (auto& p : model.parameters()) {
    if (p.entry->adapter) continue;
    torch::Tensor local = p.tensor.detach();
    if (ends_with(p.name(), ".weight")) {
      const std::string module = p.name().substr(0, p.name().size() - std::string(".weight").size());
      auto a = by_name.find(module + ".lora_A.weight");
      if (a != by_name.end()) {
        // This rank's shard of B A: B is cut like a column base's rows, A like a row base's columns.
        const torch::Tensor b = by_name.at(module + ".lora_B.weight")->tensor.detach();
        local = local.to(torch::kFloat32) + torch::matmul(b, a->second->tensor.detach()) * scaling;
      }
    }
    if (topo.dp_rank() != 0) continue;
    torch::Tensor full = gather_full(p.spec(), local.contiguous(), topo.tp());
    if (writer) writer->write(p.name(), full);
  }
  if (writer) {
    writer->finish();
    log().info("exported the merged model (base + LoRA, scaling {}) to {}", scaling, dir);
  }
  topo.world().barrier();
}

}  // namespace autotp
