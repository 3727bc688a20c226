// LoRA factors on a CausalLM: PEFT's initialisation (seeded, the same logical
// values for every tp layout), and PEFT adapters read from or written as files:
// adapter_config.json plus adapter_model.safetensors with PEFT's keys
// ("base_model.model.<module>.lora_A.weight", modules_to_save and trained
// biases under their own names), fp32, consolidated over tp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "autotp/lora/lora_config.h"
#include "autotp/model/causal_lm.h"

namespace autotp {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";
inline constexpr const char* kPeftKeyPrefix = "base_model.model.";

// The LoRA config of a PEFT adapter directory (UserError naming the file).
LoraConfig read_adapter_config(const std::string& dir);

// Initialises every LoRA factor as PEFT does (init_lora_weights): A
// Kaiming-uniform (bound 1 / sqrt(in)), or normal(0, 1 / r) for "gaussian"; B
// zeros, or Kaiming-uniform (bound 1 / sqrt(r)) for false. Seeded by `seed` and
// the factor's name. Also sets the model's adapter scaling and lora_dropout.
void init_lora_weights(CausalLM& model, const LoraConfig& lora, uint64_t seed);

// Reads a PEFT adapter's tensors into this rank's shards of the model's trained
// parameters (LoRA factors, modules_to_save, trained biases); every trained
// parameter must be in the file and every file tensor a trained parameter with
// its shape (UserError listing the differences).
void load_adapter_weights(CausalLM& model, const std::string& dir);

// The PEFT key of a trained parameter of `model`: base_model.model.<name>, with
// the bias of an adapted layer under <module>.base_layer.bias as PEFT saves it.
std::string peft_key(const CausalLM& model, const std::string& param_name);

// The module paths of the model's LoRA factors, in model order.
std::vector<std::string> adapted_modules(const CausalLM& model);

}  // namespace autotp
