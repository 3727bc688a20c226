// LoRA runs' outputs from the live trainer: the PEFT adapter (consolidated over
// tp and dp; rank 0 writes adapter_config.json and adapter_model.safetensors),
// and the merged HF model (W + scaling * B A per target, computed on each tp
// shard, then gathered as a full export is). Collective.
#pragma once
#include <string>

#include "autotp/checkpoint/checkpointing.h"
#include "autotp/lora/lora_config.h"
#include "autotp/runtime/trainer.h"

namespace autotp {

// Writes a PEFT adapter directory; `base_model` goes to base_model_name_or_path.
void save_adapter(Trainer& trainer, const LoraConfig& lora, const std::string& dir, const std::string& base_model);

// The base model with every adapter merged in, as an HF model directory (export dtype: options or the model's).
void export_merged_hf(Trainer& trainer, const std::string& dir, const ExportOptions& options);

}  // namespace autotp
