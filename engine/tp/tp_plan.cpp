#include "autotp/tp/tp_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <regex>
#include <set>

#include "autotp/base/error.h"

namespace autotp {
namespace {

using nlohmann::json;

std::vector<std::vector<Segment>> contiguous(int64_t total, int tp, int64_t unit, int64_t offset = 0) {
  std::vector<std::vector<Segment>> out(tp);
  int64_t start = 0;
  auto sizes = split_evenly(total, tp);
  for (int r = 0; r < tp; ++r) {
    out[r].push_back(Segment{offset + start * unit, sizes[r] * unit});
    start += sizes[r];
  }
  return out;
}

std::vector<std::vector<Segment>> kv_partition(const ModelConfig& c, int tp, int64_t offset) {
  auto heads = split_evenly(c.num_heads, tp);
  std::vector<std::vector<Segment>> out(tp);
  int64_t first = 0, group = c.kv_group_size();
  for (int r = 0; r < tp; ++r) {
    int64_t kv_first = first / group, kv_last = (first + heads[r] - 1) / group;
    out[r].push_back(Segment{offset + kv_first * c.head_dim, (kv_last - kv_first + 1) * c.head_dim});
    first += heads[r];
  }
  return out;
}

void append(std::vector<std::vector<Segment>>& into, const std::vector<std::vector<Segment>>& more) {
  for (size_t r = 0; r < into.size(); ++r) into[r].insert(into[r].end(), more[r].begin(), more[r].end());
}

bool is_weight(const ParamDesc& d) {
  return d.kind == ParamKind::kLinear || d.kind == ParamKind::kConv1D || d.kind == ParamKind::kEmbedding ||
         d.kind == ParamKind::kLmHead;
}

bool is_linear(const ParamDesc& d) { return d.kind == ParamKind::kLinear || d.kind == ParamKind::kConv1D; }

// A mixture-of-experts router (or Qwen2-MoE's shared-expert gate): every rank needs
// all of its logits to route every token.
bool is_router(const ParamDesc& d) {
  if (!is_linear(d)) return false;
  const Axis out = d.axes[d.out_dim()];
  return out == Axis::kExperts || out == Axis::kSharedExpertGate;
}

// The sparse block a parameter belongs to ("model.layers.3.mlp" for its router,
// experts and shared expert), empty outside one.
std::string moe_block_of(const std::string& module) {
  for (const char* part : {".experts.", ".shared_expert."}) {
    const auto at = module.find(part);
    if (at != std::string::npos) return module.substr(0, at);
  }
  return module.substr(0, module.rfind('.'));
}

std::string strip_prefix(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

// HF tp_plan keys: module paths relative to the base model, '*' for a layer index.
std::regex tp_plan_key_regex(const std::string& key) {
  std::string re;
  for (char ch : key) {
    if (ch == '*')
      re += "[0-9]+";
    else if (ch == '.')
      re += "\\.";
    else
      re += ch;
  }
  return std::regex(re);
}

// The HF tensor-parallel styles (transformers 4.5x and 5) by what autotp does with
// them. The styles differ in where HF puts the collectives (gather the output,
// split the input); autotp places its own at the block's entry and exit, with
// the same sums, so each maps to the weight layout it implies.
const std::vector<std::string> kColumnStyles = {"colwise", "colwise_rep", "colwise_gather_output", "packed_colwise",
                                                "local_colwise"};
const std::vector<std::string> kRowStyles = {"rowwise",       "rowwise_rep",  "rowwise_split_input",
                                             "packed_rowwise", "local_rowwise", "local_packed_rowwise"};
const std::vector<std::string> kVocabStyles = {"vocab", "embedding_rowwise"};
// Whole on every rank. replicated_with_grad_allreduce: autotp sums a gradient
// over tp where the layout needs it (TpPlan marks partial_grad), whatever the plan says.
const std::vector<std::string> kReplicatedStyles = {"replicate", "replicated", "local", "isolated",
                                                    "replicated_with_grad_allreduce"};
const std::vector<std::string> kExpertStyles = {"gather",      "grouped_gemm",        "ep_router",
                                                "megamoe_router", "moe_tp_experts",   "megamoe_experts",
                                                "moe_identity_expert", "all_reduce", "all_reduce_output"};

bool listed(const std::vector<std::string>& styles, const std::string& style) {
  return std::find(styles.begin(), styles.end(), style) != styles.end();
}

TpRole role_from_hf_style(const std::string& style, const ParamDesc& d, const std::string& key) {
  const std::string at = fmt::format("base_model_tp_plan['{}'] = '{}'", key, style);
  const bool vocab_param = d.kind == ParamKind::kEmbedding || d.kind == ParamKind::kLmHead;
  if (listed(kVocabStyles, style)) return TpRole::kVocab;
  // A router with its output gathered (HF's Mixtral plan says colwise_rep) computes
  // what a whole one does: autotp keeps it whole.
  if (is_router(d) && (style == "colwise_rep" || style == "colwise_gather_output")) return TpRole::kReplicated;
  if (listed(kColumnStyles, style)) return vocab_param ? TpRole::kVocab : TpRole::kColumn;
  if (listed(kRowStyles, style)) return vocab_param ? TpRole::kVocab : TpRole::kRow;
  if (listed(kReplicatedStyles, style)) return TpRole::kReplicated;
  // HF marks the norms that run on sequence shards: their weights stay whole; whether
  // they see 1/tp of the tokens is tensor_parallel.sequence_parallel's to say.
  if (style == "sequence_parallel") {
    AUTOTP_USER_CHECK(d.kind == ParamKind::kNorm,
                      "{}: sequence_parallel applies to norms only (allowed for {}: colwise, rowwise, replicate)",
                      at, d.name);
    return TpRole::kReplicated;
  }
  if (style == "embedding_colwise")
    throw_user_error("{}: splitting the embedding's hidden dim would split the residual stream; use "
                     "embedding_rowwise (vocab-parallel)",
                     at);
  if (listed(kExpertStyles, style))
    throw_user_error("{}: an expert-parallel style; autotp splits each expert across the tp ranks (experts "
                     "colwise / rowwise, the router replicated) and has no expert parallelism",
                     at);
  if (style == "mla_kv_a_proj")
    throw_user_error("{}: multi-head latent attention is not implemented", at);
  throw_user_error("{} is not a tensor-parallel style autotp knows (allowed: {}, {}, {}, {})", at,
                   fmt::join(kColumnStyles, ", "), fmt::join(kRowStyles, ", "), fmt::join(kVocabStyles, ", "),
                   fmt::join(kReplicatedStyles, ", "));
}

// Structural rules: only the layout, never the names.
std::pair<TpRole, std::string> structural_role(const ParamDesc& d) {
  if (d.kind == ParamKind::kEmbedding || d.kind == ParamKind::kLmHead)
    return {TpRole::kVocab, "rule: token embedding / LM head"};
  if (is_router(d)) return {TpRole::kReplicated, "rule: router (every rank routes every token)"};
  if (is_linear(d)) {
    bool reads = d.axes[d.in_dim()] == Axis::kHidden, writes = d.axes[d.out_dim()] == Axis::kHidden;
    if (writes && !reads) return {TpRole::kRow, "rule: writes the hidden stream"};
    if (reads && !writes) return {TpRole::kColumn, "rule: reads the hidden stream"};
  }
  return {TpRole::kReplicated, "rule: replicated"};
}

std::string shape_str(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

const char* tp_role_name(TpRole role) {
  switch (role) {
    case TpRole::kColumn: return "column";
    case TpRole::kRow: return "row";
    case TpRole::kVocab: return "vocab";
    case TpRole::kReplicated: return "replicated";
  }
  return "?";
}

TpRole parse_tp_role(const std::string& name, const std::string& where) {
  for (TpRole r : {TpRole::kColumn, TpRole::kRow, TpRole::kVocab, TpRole::kReplicated})
    if (name == tp_role_name(r)) return r;
  throw_user_error("{}: partition_type '{}' is not valid (allowed: column, row, vocab, replicated)", where, name);
}

// `shape` is either the sub-parameter sizes along the split dim ([q, k, v]), or
// DeepSpeed's per-dim form: the split dim's entry is a count of equal parts or a
// list of sizes, every other dim -1 ([2, -1] for gate_up, [[q, k, v], -1]).
void parse_spec_shape(const json& shape, const std::string& at, LayerSpec& spec) {
  const std::string allowed = "allowed: sub-parameter sizes [a, b, ...], or DeepSpeed's [n, -1] / [[a, b, ...], -1] "
                              "with the split dim's entry first for column and second for row";
  AUTOTP_USER_CHECK(shape.is_array() && !shape.empty(), "{}.shape must be a non-empty array ({})", at, allowed);
  const bool deepspeed_form = std::any_of(shape.begin(), shape.end(), [](const json& v) {
    return v.is_array() || (v.is_number_integer() && v.get<int64_t>() == -1);
  });
  auto positive = [&](const json& v) {
    AUTOTP_USER_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, "{}.shape: {} is not a positive integer ({})",
                      at, v.dump(), allowed);
    return v.get<int64_t>();
  };
  if (!deepspeed_form) {
    for (const auto& v : shape) spec.shape.push_back(positive(v));
    return;
  }
  const size_t split_dim = spec.role == TpRole::kRow ? 1 : 0;
  AUTOTP_USER_CHECK(shape.size() == 2 && (spec.role == TpRole::kColumn || spec.role == TpRole::kRow),
                    "{}.shape {}: the DeepSpeed form describes the two dims of a column or row weight ({})", at,
                    shape.dump(), allowed);
  AUTOTP_USER_CHECK(shape[1 - split_dim] == -1, "{}.shape {}: the dim that is not split must be -1 ({})", at,
                    shape.dump(), allowed);
  const json& parts = shape[split_dim];
  if (parts.is_array()) {
    AUTOTP_USER_CHECK(!parts.empty(), "{}.shape {}: empty list of sizes ({})", at, shape.dump(), allowed);
    for (const auto& v : parts) spec.shape.push_back(positive(v));
  } else {
    spec.equal_parts = positive(parts);
  }
}

std::vector<LayerSpec> parse_partition_config(const json& j) {
  const std::string where = "tensor_parallel.partition_config";
  AUTOTP_USER_CHECK(j.is_object(), "{} must be an object with 'layer_specs'", where);
  for (auto& [key, value] : j.items())
    AUTOTP_USER_CHECK(key == "layer_specs" || key == "use_default_specs",
                      "{}: unknown key '{}' (allowed: layer_specs, use_default_specs)", where, key);
  // DeepSpeed: false shards only what the specs match. autotp's own rules always
  // decide the tensors no spec matches.
  AUTOTP_USER_CHECK(!j.contains("use_default_specs") || j["use_default_specs"] == true,
                    "{}.use_default_specs is {} (allowed: true: autotp's rules decide every tensor no layer_spec "
                    "matches; to keep one whole, give it a spec with partition_type replicated)",
                    where, j.value("use_default_specs", json()).dump());
  std::vector<LayerSpec> specs;
  if (!j.contains("layer_specs")) return specs;
  AUTOTP_USER_CHECK(j["layer_specs"].is_array(), "{}.layer_specs must be an array", where);
  int i = 0;
  for (const auto& item : j["layer_specs"]) {
    std::string at = fmt::format("{}.layer_specs[{}]", where, i++);
    AUTOTP_USER_CHECK(item.is_object(), "{} must be an object", at);
    for (auto& [key, value] : item.items())
      AUTOTP_USER_CHECK(key == "patterns" || key == "partition_type" || key == "shape" || key == "partition_dim",
                        "{}: unknown key '{}' (allowed: patterns, partition_type, shape, partition_dim)", at, key);
    LayerSpec spec;
    AUTOTP_USER_CHECK(item.contains("patterns") && item["patterns"].is_array() && !item["patterns"].empty(),
                      "{}.patterns must be a non-empty array of regexes", at);
    for (const auto& p : item["patterns"]) {
      AUTOTP_USER_CHECK(p.is_string(), "{}.patterns must hold strings", at);
      try {
        std::regex check(p.get<std::string>());
      } catch (const std::regex_error& e) {
        throw_user_error("{}.patterns: '{}' is not a valid regex ({})", at, p.get<std::string>(), e.what());
      }
      spec.patterns.push_back(p.get<std::string>());
    }
    AUTOTP_USER_CHECK(item.contains("partition_type") && item["partition_type"].is_string(),
                      "{}.partition_type is required (allowed: column, row, vocab, replicated)", at);
    spec.role = parse_tp_role(item["partition_type"].get<std::string>(), at);
    if (item.contains("partition_dim")) {
      // The dim of an HF [out, in] weight the role splits: column 0, row 1.
      const int64_t expected = spec.role == TpRole::kRow ? 1 : 0;
      AUTOTP_USER_CHECK(item["partition_dim"].is_number_integer() && item["partition_dim"].get<int64_t>() == expected &&
                            (spec.role == TpRole::kColumn || spec.role == TpRole::kRow),
                        "{}.partition_dim is {} (allowed: 0 for column, 1 for row; the role decides the dim)", at,
                        item["partition_dim"].dump());
    }
    if (item.contains("shape")) parse_spec_shape(item["shape"], at, spec);
    specs.push_back(std::move(spec));
  }
  return specs;
}

std::vector<std::vector<Segment>> axis_partition(const ModelConfig& c, Axis axis, int tp) {
  switch (axis) {
    case Axis::kHeads:
      AUTOTP_USER_CHECK(c.num_heads >= tp, "autotp_size {} exceeds num_attention_heads {} (allowed: 1..{})", tp,
                        c.num_heads, c.num_heads);
      return contiguous(c.num_heads, tp, c.head_dim);
    case Axis::kKvHeads:
      AUTOTP_USER_CHECK(c.num_heads >= tp, "autotp_size {} exceeds num_attention_heads {} (allowed: 1..{})", tp,
                        c.num_heads, c.num_heads);
      return kv_partition(c, tp, 0);
    case Axis::kQkv: {
      auto parts = axis_partition(c, Axis::kHeads, tp);
      append(parts, kv_partition(c, tp, c.num_heads * c.head_dim));
      append(parts, kv_partition(c, tp, (c.num_heads + c.num_kv_heads) * c.head_dim));
      return parts;
    }
    case Axis::kGateUp: {  // gate and up each split like the intermediate axis
      auto parts = axis_partition(c, Axis::kIntermediate, tp);
      append(parts, contiguous(c.intermediate_size, tp, 1, c.intermediate_size));
      return parts;
    }
    case Axis::kIntermediate:
    case Axis::kExpertIntermediate:
    case Axis::kSharedExpertIntermediate:
    case Axis::kVocab: {
      int64_t total = axis_size(c, axis);
      AUTOTP_USER_CHECK(total >= tp, "autotp_size {} exceeds the {} size {}", tp, axis_name(axis), total);
      return contiguous(total, tp, 1);
    }
    case Axis::kHidden:
    case Axis::kPositions:
    case Axis::kHeadDim:
    case Axis::kExperts:
    case Axis::kSharedExpertGate: break;
  }
  throw_user_error("the {} axis cannot be split across tensor-parallel ranks", axis_name(axis));
}

nlohmann::json builtin_name_plan(const ModelConfig& c) {
  if (c.family == ModelFamily::kGpt2)
    return {{"wte", "vocab"},
            {"h.*.attn.c_attn", "packed_colwise"},
            {"h.*.attn.c_proj", "rowwise"},
            {"h.*.mlp.c_fc", "colwise"},
            {"h.*.mlp.c_proj", "rowwise"}};
  if (c.fused_projections)
    return {{"embed_tokens", "vocab"},
            {"layers.*.self_attn.qkv_proj", "packed_colwise"},
            {"layers.*.self_attn.o_proj", "rowwise"},
            {"layers.*.mlp.gate_up_proj", "packed_colwise"},
            {"layers.*.mlp.down_proj", "rowwise"},
            {"lm_head", "colwise_rep"}};
  json plan = {{"embed_tokens", "vocab"},
          {"layers.*.self_attn.q_proj", "colwise"},
          {"layers.*.self_attn.k_proj", "colwise"},
          {"layers.*.self_attn.v_proj", "colwise"},
          {"layers.*.self_attn.o_proj", "rowwise"},
          {"layers.*.mlp.gate_proj", "colwise"},
          {"layers.*.mlp.up_proj", "colwise"},
          {"layers.*.mlp.down_proj", "rowwise"},
          {"lm_head", "colwise_rep"}};
  if (c.num_experts > 0) {  // each expert split like an MLP; the router whole
    const std::string block = "layers.*." + c.moe_block;
    plan[block + ".gate"] = "replicated_with_grad_allreduce";
    plan[block + ".experts.*." + c.expert_projections[0]] = "colwise";
    plan[block + ".experts.*." + c.expert_projections[1]] = "colwise";
    plan[block + ".experts.*." + c.expert_projections[2]] = "rowwise";
    if (c.shared_expert_intermediate_size > 0) {
      plan[block + ".shared_expert.gate_proj"] = "colwise";
      plan[block + ".shared_expert.up_proj"] = "colwise";
      plan[block + ".shared_expert.down_proj"] = "rowwise";
      plan[block + ".shared_expert_gate"] = "replicated_with_grad_allreduce";
    }
  }
  if (c.qk_norm) {
    plan["layers.*.self_attn.q_norm"] = "replicated_with_grad_allreduce";
    plan["layers.*.self_attn.k_norm"] = "replicated_with_grad_allreduce";
  }
  return plan;
}

namespace {

// Where a parameter's role can come from besides the structural rules: the
// name plan (the config's base_model_tp_plan or the built-in one) and the
// user's layer_specs, their regexes compiled once.
struct RoleSources {
  json name_plan;
  std::string plan_label;  // where name_plan comes from, for `autotp plan`
  std::vector<std::pair<std::string, std::regex>> plan_keys;
  std::vector<std::vector<std::regex>> user_regex;
  std::vector<bool> spec_used;
};

RoleSources role_sources(const ModelConfig& config, const TpPlanOptions& options) {
  RoleSources r;
  bool config_has_plan = config.raw.contains("base_model_tp_plan") && config.raw["base_model_tp_plan"].is_object();
  if (options.rules == PlanRules::kNames)
    r.name_plan = config_has_plan ? config.raw["base_model_tp_plan"] : builtin_name_plan(config);
  else if (options.rules == PlanRules::kAuto && config_has_plan)
    r.name_plan = config.raw["base_model_tp_plan"];
  r.plan_label = config_has_plan ? "HF plan (config.json)" : "built-in HF-style plan";
  for (auto& [key, value] : r.name_plan.items()) {
    AUTOTP_USER_CHECK(value.is_string(), "base_model_tp_plan['{}'] must be a string", key);
    r.plan_keys.emplace_back(key, tp_plan_key_regex(key));
  }
  for (const auto& spec : options.layer_specs) {
    r.user_regex.emplace_back();
    for (const auto& p : spec.patterns) r.user_regex.back().emplace_back(p);
  }
  r.spec_used.assign(options.layer_specs.size(), false);
  return r;
}

// The first user layer_spec whose pattern matches `d` (weights, norms and
// position embeddings only), recorded as used; null when none does.
const LayerSpec* match_user_spec(const ParamDesc& d, const TpPlanOptions& options, RoleSources& r, PlanEntry& e) {
  if (!is_weight(d) && d.kind != ParamKind::kNorm && d.kind != ParamKind::kPositionEmbedding) return nullptr;
  for (size_t s = 0; s < options.layer_specs.size(); ++s)
    for (size_t p = 0; p < r.user_regex[s].size(); ++p)
      if (std::regex_match(d.name, r.user_regex[s][p])) {
        r.spec_used[s] = true;
        e.role = options.layer_specs[s].role;
        e.source = fmt::format("user pattern '{}'", options.layer_specs[s].patterns[p]);
        return &options.layer_specs[s];
      }
  return nullptr;
}

// A role from the name plan (a module it does not list stays whole), else from the structure.
void assign_name_or_structural_role(const ModelConfig& config, const ParamDesc& d, const RoleSources& r,
                                    PlanEntry& e) {
  std::string module = strip_prefix(d.module, config.base_prefix());
  for (const auto& [key, re] : r.plan_keys)
    if (std::regex_match(module, re) || std::regex_match(d.module, re)) {
      std::string style = r.name_plan[key].get<std::string>();
      e.role = role_from_hf_style(style, d, key);
      e.source = fmt::format("{} '{}': {}", r.plan_label, key, style);
      return;
    }
  if (!r.plan_keys.empty()) {
    e.role = TpRole::kReplicated;
    e.source = r.plan_label + ": not listed";
    return;
  }
  std::tie(e.role, e.source) = structural_role(d);
}

// The role checked against the parameter's layout, and its ShardSpec.
ShardSpec checked_spec(const ModelConfig& config, const ParamDesc& d, const PlanEntry& e, const LayerSpec* user,
                       int tp) {
  const std::string where = fmt::format("tensor-parallel plan for '{}' ({})", d.name, e.source);
  if (e.role == TpRole::kVocab) {
    AUTOTP_USER_CHECK(d.kind == ParamKind::kEmbedding || d.kind == ParamKind::kLmHead,
                      "{}: vocab partitioning applies only to token embeddings and the LM head", where);
    return ShardSpec::split(d.shape, 0, axis_partition(config, Axis::kVocab, tp));
  }
  if (e.role != TpRole::kColumn && e.role != TpRole::kRow) return ShardSpec::replicated(d.shape, tp);
  bool column = e.role == TpRole::kColumn;
  AUTOTP_USER_CHECK(is_linear(d) || d.kind == ParamKind::kBias,
                    "{}: {} partitioning applies only to linear layers (this is a {})", where,
                    tp_role_name(e.role), param_kind_name(d.kind));
  AUTOTP_USER_CHECK(!is_router(d), "{}: a router must be replicated (every rank routes every token; allowed: "
                                   "replicated)", where);
  int64_t dim = d.kind == ParamKind::kBias ? 0 : (column ? d.out_dim() : d.in_dim());
  Axis axis = d.axes[dim];
  AUTOTP_USER_CHECK(axis != Axis::kHidden,
                    "{}: a {}-parallel layer would split the hidden stream; use {} for this layer", where,
                    tp_role_name(e.role), column ? "row" : "column");
  if (user && (!user->shape.empty() || user->equal_parts > 0)) {
    // A user-declared sub-parameter layout must agree with the model's own
    // (e.g. [q, k, v] sizes of a fused projection): each part is split by heads.
    std::vector<int64_t> shape = user->shape;
    if (user->equal_parts > 0) {
      AUTOTP_USER_CHECK(d.shape[dim] % user->equal_parts == 0, "{}: shape asks for {} equal parts of dim {} (size {})",
                        where, user->equal_parts, dim, d.shape[dim]);
      shape.assign(user->equal_parts, d.shape[dim] / user->equal_parts);
    }
    int64_t sum = 0;
    for (int64_t s : shape) sum += s;
    AUTOTP_USER_CHECK(sum == d.shape[dim], "{}: shape {} sums to {}, but dim {} has size {}", where,
                      shape_str(shape), sum, dim, d.shape[dim]);
    std::vector<int64_t> expected;
    if (axis == Axis::kQkv)
      expected = {config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                  config.num_kv_heads * config.head_dim};
    else if (axis == Axis::kGateUp)
      expected = {config.intermediate_size, config.intermediate_size};
    else
      expected = {d.shape[dim]};
    AUTOTP_USER_CHECK(shape == expected, "{}: shape {} does not match the layout of this weight {}", where,
                      shape_str(shape), shape_str(expected));
  }
  return ShardSpec::split(d.shape, dim, axis_partition(config, axis, tp));
}

// A block's input projections are column-parallel exactly when its output projection is row-parallel.
void check_blocks(const std::vector<PlanEntry>& entries) {
  std::map<std::string, std::vector<const PlanEntry*>> blocks;
  for (const auto& e : entries)
    if (is_linear(e.desc)) blocks[e.desc.module.substr(0, e.desc.module.rfind('.'))].push_back(&e);
  for (const auto& [block, members] : blocks) {
    std::set<bool> split;
    for (const auto* e : members) split.insert(e->role != TpRole::kReplicated);
    if (split.size() > 1) {
      std::vector<std::string> roles;
      for (const auto* e : members) roles.push_back(fmt::format("{}={}", e->desc.name, tp_role_name(e->role)));
      throw_user_error(
          "tensor-parallel plan: block '{}' mixes split and replicated layers ({}); its input projections must be "
          "column-parallel exactly when its output projection is row-parallel",
          block, fmt::join(roles, ", "));
    }
  }
}

// The experts of a sparse block (and its shared expert) are all split or all whole:
// the block sums its experts' outputs before one reduction over tp.
void check_moe_blocks(const std::vector<PlanEntry>& entries) {
  std::map<std::string, std::map<bool, std::string>> blocks;  // block -> split? -> an example
  for (const auto& e : entries) {
    const std::string block = moe_block_of(e.desc.module);
    const bool in_expert = block != e.desc.module.substr(0, e.desc.module.rfind('.'));
    if (is_linear(e.desc) && in_expert) blocks[block][e.role != TpRole::kReplicated] = e.desc.name;
  }
  for (const auto& [block, kinds] : blocks)
    AUTOTP_USER_CHECK(kinds.size() == 1,
                      "tensor-parallel plan: the experts of '{}' are split in part ({} is split, {} is whole); split "
                      "every expert (gate/up column, down row) or none",
                      block, kinds.at(true), kinds.at(false));
}

// A per-head tensor (Axis::kHeadDim) serves the heads of its attention block:
// when the block is split, every rank holds it whole but sees only its heads.
// A router of split experts weighs each rank's part of their outputs: its gradient
// is partial in the same way.
void mark_partial_grads(std::vector<PlanEntry>& entries, int tp) {
  if (tp == 1) return;  // one rank sees every head
  std::set<std::string> split_blocks, split_moe_blocks;
  for (const auto& e : entries)
    if (is_linear(e.desc) && e.role != TpRole::kReplicated) {
      split_blocks.insert(e.desc.module.substr(0, e.desc.module.rfind('.')));
      split_moe_blocks.insert(moe_block_of(e.desc.module));
    }
  for (auto& e : entries) {
    if (is_router(e.desc) && e.role == TpRole::kReplicated && split_moe_blocks.count(moe_block_of(e.desc.module))) {
      e.partial_grad = true;
      e.source += "; gradient summed over tp (weighs each rank's part of the experts)";
      continue;
    }
    if (e.desc.axes != std::vector<Axis>{Axis::kHeadDim} || e.role != TpRole::kReplicated) continue;
    if (!split_blocks.count(e.desc.module.substr(0, e.desc.module.rfind('.')))) continue;
    e.partial_grad = true;
    e.source += "; gradient summed over tp (applied to each rank's heads)";
  }
}

// Sequence parallelism: the hidden-stream norms, the biases added after a row
// layer's reduce-scatter and GPT-2's position embedding see only this rank's tokens.
void mark_sequence_parallel_grads(std::vector<PlanEntry>& entries) {
  for (auto& e : entries) {
    const bool hidden_norm = e.desc.kind == ParamKind::kNorm && e.desc.axes == std::vector<Axis>{Axis::kHidden};
    const bool row_bias = e.desc.kind == ParamKind::kBias && e.role == TpRole::kReplicated;
    const bool positions = e.desc.kind == ParamKind::kPositionEmbedding;
    if (!(hidden_norm || row_bias || positions) || e.partial_grad) continue;
    e.partial_grad = true;
    e.source += "; gradient summed over tp (sequence parallel: each rank sees its tokens)";
  }
}

}  // namespace

namespace {
// A routed expert's tensor ("...experts.5.w1.weight": 5), -1 for any other (the shared expert included).
int64_t routed_expert_of(const ParamDesc& d) {
  if (std::find(d.axes.begin(), d.axes.end(), Axis::kExpertIntermediate) == d.axes.end()) return -1;
  const std::string marker = ".experts.";
  const size_t at = d.name.rfind(marker);
  TORCH_INTERNAL_ASSERT(at != std::string::npos, "expert tensor without an expert index: ", d.name);
  return std::stoll(d.name.substr(at + marker.size()));
}
}  // namespace

TpPlan TpPlan::build(const ModelConfig& config, const TpPlanOptions& options) {
  const int tp = options.tp_size;
  AUTOTP_USER_CHECK(tp >= 1, "autotp_size must be at least 1, got {}", tp);
  RoleSources sources = role_sources(config, options);
  TpPlan plan;
  plan.tp_size_ = tp;
  std::map<std::string, size_t> weight_of_module;  // module -> entry index
  for (const auto& d : describe_parameters(config)) {
    PlanEntry e;
    e.desc = d;
    e.expert = routed_expert_of(d);
    const LayerSpec* user = match_user_spec(d, options, sources, e);
    if (!user && d.kind == ParamKind::kBias) {
      // A bias follows its weight: split with a column layer, whole after a row layer's reduce.
      auto it = weight_of_module.find(d.module);
      TORCH_INTERNAL_ASSERT(it != weight_of_module.end(), "bias before its weight: ", d.name);
      const PlanEntry& weight = plan.entries_[it->second];
      e.role = weight.role == TpRole::kColumn ? TpRole::kColumn : TpRole::kReplicated;
      e.source = fmt::format("follows {}", weight.desc.name);
    } else if (!user) {
      assign_name_or_structural_role(config, d, sources, e);
    }
    e.spec = checked_spec(config, d, e, user, tp);
    if (is_linear(d)) weight_of_module[d.module] = plan.entries_.size();
    plan.index_[d.name] = plan.entries_.size();
    plan.entries_.push_back(std::move(e));
  }
  for (size_t s = 0; s < sources.spec_used.size(); ++s)
    AUTOTP_USER_CHECK(sources.spec_used[s],
                      "tensor_parallel.partition_config.layer_specs[{}]: patterns {} match no parameter", s,
                      fmt::join(options.layer_specs[s].patterns, ", "));
  check_blocks(plan.entries_);
  check_moe_blocks(plan.entries_);
  mark_partial_grads(plan.entries_, tp);
  plan.sequence_parallel_ = options.sequence_parallel && tp > 1;
  plan.overlap_comm_ = options.overlap_comm && tp > 1;
  if (plan.sequence_parallel_) mark_sequence_parallel_grads(plan.entries_);
  return plan;
}

const PlanEntry& TpPlan::entry(const std::string& name) const {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "TpPlan::entry: no parameter named '", name, "'");
  return entries_[it->second];
}

void TpPlan::set_remote(const std::string& name, bool remote) {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "TpPlan::set_remote: no parameter named '", name, "'");
  entries_[it->second].remote = remote;
}

void TpPlan::set_frozen(const std::string& name, bool frozen) {
  auto it = index_.find(name);
  TORCH_CHECK(it != index_.end(), "TpPlan::set_frozen: no parameter named '", name, "'");
  entries_[it->second].frozen = frozen;
}

void TpPlan::insert_after(const std::string& anchor, std::vector<PlanEntry> entries) {
  auto it = index_.find(anchor);
  TORCH_CHECK(it != index_.end(), "TpPlan::insert_after: no parameter named '", anchor, "'");
  entries_.insert(entries_.begin() + static_cast<std::ptrdiff_t>(it->second) + 1,
                  std::make_move_iterator(entries.begin()), std::make_move_iterator(entries.end()));
  index_.clear();
  for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].desc.name] = i;
}

std::vector<int64_t> TpPlan::rank_bytes(int64_t element_size) const {
  std::vector<int64_t> bytes(tp_size_, 0);
  for (const auto& e : entries_)
    if (!e.remote)
      for (int r = 0; r < tp_size_; ++r) bytes[r] += e.spec.local_numel(r) * element_size;
  return bytes;
}

std::string TpPlan::table() const {
  std::string out = fmt::format("{:<48} {:<10} {:<14} {:<40} {}\n", "parameter", "role", "global shape",
                                "shard shape per rank", "decided by");
  for (const auto& e : entries_) {
    std::vector<std::string> shards;
    bool all_same = true;
    for (int r = 0; r < tp_size_; ++r) {
      shards.push_back(shape_str(e.spec.local_shape(r)));
      all_same = all_same && shards[r] == shards[0];
    }
    std::string shard_text = all_same ? fmt::format("all {}", shards[0]) : fmt::format("{}", fmt::join(shards, " "));
    if (e.spec.has_overlap() && !e.spec.is_replicated()) shard_text += " (kv heads shared)";
    if (e.partial_grad && e.adapter) shard_text += " (grad summed over tp)";
    if (e.frozen) shard_text += " frozen";
    if (e.remote) shard_text = "held by another ep rank";
    out += fmt::format("{:<48} {:<10} {:<14} {:<40} {}\n", e.desc.name, tp_role_name(e.role),
                       shape_str(e.desc.shape), shard_text, e.source);
  }
  auto bytes = rank_bytes(4);
  for (int r = 0; r < tp_size_; ++r)
    out += fmt::format("rank {}: {} parameters, {:.2f} MiB in fp32\n", r, bytes[r] / 4, bytes[r] / 1048576.0);
  return out;
}

}  // namespace autotp
