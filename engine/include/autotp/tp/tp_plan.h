// TpPlan: the tensor-parallel role and ShardSpec of every parameter. Roles come
// from, in order of precedence: user patterns (tensor_parallel.partition_config),
// the HF `base_model_tp_plan` of the config, then structural rules that read
// only the parameter layout (a linear writing into the hidden stream is
// row-parallel, one reading it is column-parallel, token embeddings and the LM
// head are vocab-parallel, everything else is replicated).
#pragma once
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "autotp/arch/param_layout.h"
#include "autotp/tp/shard_spec.h"

namespace autotp {

enum class TpRole { kColumn, kRow, kVocab, kReplicated };
const char* tp_role_name(TpRole role);
TpRole parse_tp_role(const std::string& name, const std::string& where);  // UserError lists allowed

// One entry of tensor_parallel.partition_config.layer_specs.
struct LayerSpec {
  std::vector<std::string> patterns;  // ECMAScript regexes matched against the full parameter name
  TpRole role = TpRole::kReplicated;
  // Optional sub-parameters of a fused weight along the split dim: their sizes, or
  // (DeepSpeed's form, e.g. [2, -1]) equal_parts equal ones.
  std::vector<int64_t> shape;
  int64_t equal_parts = 0;
};

// Which rule source decides when no user pattern matches.
enum class PlanRules {
  kAuto,        // the config's base_model_tp_plan when present, else structural rules
  kStructural,  // structural rules only
  kNames,       // HF-style name plan (the config's, or the architecture's built-in one)
};

struct TpPlanOptions {
  int tp_size = 1;
  std::vector<LayerSpec> layer_specs;   // user patterns, first match wins
  PlanRules rules = PlanRules::kAuto;
  // Norms, residuals and dropout on a 1/tp slice of the sequence (Korthikanti et al.):
  // the hidden-stream norms' and row biases' gradients become partial sums over tp.
  bool sequence_parallel = false;
  // tp_overlap_comm: tp collectives overlapped with compute (Domino's split of the
  // micro-batch, the input-gradient reduction behind the weight-gradient GEMMs).
  bool overlap_comm = false;
};

// Parses {"layer_specs": [...]} (the value of partition_config). UserError on bad keys.
std::vector<LayerSpec> parse_partition_config(const nlohmann::json& json);

struct PlanEntry {
  ParamDesc desc;
  TpRole role = TpRole::kReplicated;
  ShardSpec spec;
  // Why: "user pattern '...'", "HF plan (config.json) 'layers.*.self_attn.q_proj': colwise",
  // "built-in HF-style plan ...", "rule: reads the hidden stream".
  std::string source;
  // A replicated tensor applied to each rank's own heads (Qwen3's q/k norms under
  // split attention): each rank's gradient is the part of its heads, and the
  // gradient is their sum over the tp group (sum_partial_grads).
  bool partial_grad = false;
  // Not trained (the base model under LoRA): no gradient, no master copy, no optimizer state.
  bool frozen = false;
  // A LoRA factor (lora_A / lora_B) of the base layer desc.module: not part of the HF model.
  bool adapter = false;
  // Mixture of experts: the routed expert this tensor belongs to (-1: none), and
  // whether another expert-parallel rank holds it (no tensor on this rank; expert_parallel.h).
  int64_t expert = -1;
  bool remote = false;
};

class TpPlan {
 public:
  // UserError when tp_size does not fit the model (more ranks than query heads,
  // inconsistent roles inside a block, a pattern that matches nothing...).
  static TpPlan build(const ModelConfig& config, const TpPlanOptions& options);

  int tp_size() const { return tp_size_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  bool overlap_comm() const { return overlap_comm_; }
  const std::vector<PlanEntry>& entries() const { return entries_; }
  const PlanEntry& entry(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) > 0; }

  // LoRA (lora/lora_plan.h): freezes an entry, or inserts entries right after `anchor`'s.
  void set_frozen(const std::string& name, bool frozen);
  // Expert parallelism (tp/expert_parallel.h): an expert tensor another rank holds.
  void set_remote(const std::string& name, bool remote);
  void insert_after(const std::string& anchor, std::vector<PlanEntry> entries);

  // The table printed by `autotp plan`.
  std::string table() const;
  // Per-rank parameter bytes at `element_size` bytes per element.
  std::vector<int64_t> rank_bytes(int64_t element_size) const;

 private:
  int tp_size_ = 1;
  bool sequence_parallel_ = false, overlap_comm_ = false;
  std::vector<PlanEntry> entries_;
  std::map<std::string, size_t> index_;
};

// The per-rank segments of an axis split `tp` ways: query heads as evenly as
// possible; kv heads = those the rank's query heads use (replicated where
// shared); fused qkv = the three parts each split by heads; other axes evenly.
std::vector<std::vector<Segment>> axis_partition(const ModelConfig& config, Axis axis, int tp);

// The HF-style name plan built into each architecture (what base_model_tp_plan says).
nlohmann::json builtin_name_plan(const ModelConfig& config);

}  // namespace autotp
