#include "autotp/zero/zero_config.h"

namespace autotp {

namespace {

// DeepSpeed's offload sections; their other keys tune the transfers and the NVMe path.
std::string read_offload(const JsonSection& zero, const std::string& key, bool& pin) {
  if (!zero.has(key)) return "none";
  const JsonSection o = zero.section(key, {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size",
                                           "max_in_cpu", "fast_init", "ratio", "pipeline", "pipeline_read",
                                           "pipeline_write"});
  const std::string device = o.string("device", "none");
  o.check(device == "none" || device == "cpu", "device",
          device == "nvme" ? "cpu or none: offloading to NVMe is not supported; use \"device\": \"cpu\""
                           : "cpu or none");
  pin = o.boolean("pin_memory", false);  // matters for CUDA transfers only
  return device;
}

}  // namespace

ZeroConfig ZeroConfig::read(const JsonSection& top) {
  ZeroConfig z;
  // DeepSpeed accepts the stage3_ spelling as an alias of gather_16bit_weights_on_model_save.
  JsonSection s =
      top.section("zero_optimization", {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                                        "contiguous_gradients", "stage3_prefetch_bucket_size",
                                        "stage3_param_persistence_threshold", "gather_16bit_weights_on_model_save",
                                        "stage3_gather_16bit_weights_on_model_save", "stage3_max_live_parameters",
                                        "stage3_max_reuse_distance", "sub_group_size", "allgather_partitions",
                                        "reduce_scatter", "round_robin_gradients", "offload_optimizer",
                                        "offload_param"});
  int64_t stage = s.integer("stage", z.stage);
  s.check(stage >= 0 && stage <= 3, "stage", "0, 1, 2, 3");
  z.stage = static_cast<int>(stage);
  z.reduce_bucket_size = s.integer("reduce_bucket_size", z.reduce_bucket_size);
  s.check(z.reduce_bucket_size >= 1, "reduce_bucket_size", "an integer >= 1 (elements)");
  z.allgather_bucket_size = s.integer("allgather_bucket_size", z.allgather_bucket_size);
  s.check(z.allgather_bucket_size >= 1, "allgather_bucket_size", "an integer >= 1 (elements)");
  if (s.has("overlap_comm")) z.overlap_comm = s.boolean("overlap_comm", true);
  z.contiguous_gradients = s.boolean("contiguous_gradients", z.contiguous_gradients);
  z.stage3_prefetch_bucket_size = s.integer("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size);
  s.check(z.stage3_prefetch_bucket_size >= 0, "stage3_prefetch_bucket_size", "an integer >= 0 (elements)");
  z.stage3_param_persistence_threshold =
      s.integer("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold);
  s.check(z.stage3_param_persistence_threshold >= 0, "stage3_param_persistence_threshold",
          "an integer >= 0 (elements; 0 = partition every tensor)");
  const std::string alias = "stage3_gather_16bit_weights_on_model_save";
  bool plain = s.boolean("gather_16bit_weights_on_model_save", false);
  bool staged = s.boolean(alias, false);
  if (s.has("gather_16bit_weights_on_model_save") && s.has(alias) && plain != staged)
    s.fail("{} and {} disagree (they are the same setting; give one)",
           s.where("gather_16bit_weights_on_model_save"), s.where(alias));
  z.gather_16bit_weights_on_model_save = plain || staged;
  for (auto [key, value] : {std::pair{"stage3_max_live_parameters", &z.stage3_max_live_parameters},
                            std::pair{"stage3_max_reuse_distance", &z.stage3_max_reuse_distance},
                            std::pair{"sub_group_size", &z.sub_group_size}}) {
    *value = s.integer(key, *value);
    s.check(*value >= 0, key, "an integer >= 0 (elements)");
  }
  z.allgather_partitions = s.boolean("allgather_partitions", z.allgather_partitions);
  z.reduce_scatter = s.boolean("reduce_scatter", z.reduce_scatter);
  z.round_robin_gradients = s.boolean("round_robin_gradients", z.round_robin_gradients);
  z.offload_optimizer_device = read_offload(s, "offload_optimizer", z.offload_optimizer_pin_memory);
  z.offload_param_device = read_offload(s, "offload_param", z.offload_param_pin_memory);
  if (z.offloads_params() && !z.offloads_optimizer())
    s.fail("{} is \"cpu\" but {} is not: autotp offloads the stage-3 parameters only together with the "
           "optimizer (allowed: offload_optimizer {{\"device\": \"cpu\"}} as well, or offload_param \"none\")",
           s.where("offload_param.device"), s.where("offload_optimizer.device"));
  return z;
}

nlohmann::json ZeroConfig::to_json() const {
  nlohmann::json j = {{"stage", stage},
                      {"reduce_bucket_size", reduce_bucket_size},
                      {"allgather_bucket_size", allgather_bucket_size},
                      {"contiguous_gradients", contiguous_gradients},
                      {"stage3_prefetch_bucket_size", stage3_prefetch_bucket_size},
                      {"stage3_param_persistence_threshold", stage3_param_persistence_threshold},
                      {"gather_16bit_weights_on_model_save", gather_16bit_weights_on_model_save}};
  if (overlap_comm) j["overlap_comm"] = *overlap_comm;  // unset: by device
  j["stage3_max_live_parameters"] = stage3_max_live_parameters;
  if (offload_optimizer_device != "none")
    j["offload_optimizer"] = {{"device", offload_optimizer_device}, {"pin_memory", offload_optimizer_pin_memory}};
  if (offload_param_device != "none")
    j["offload_param"] = {{"device", offload_param_device}, {"pin_memory", offload_param_pin_memory}};
  return j;
}

}  // namespace autotp
