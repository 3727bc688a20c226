// ShardedModel: what a training engine needs of a model whose parameters are
// this rank's tensor-parallel shards: the parameters (each with its plan entry),
// the dtype and device, and the parameter uses it announces through hooks.
// ZeRO is written against this interface only (CausalLM implements it).
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "autotp/tp/tp_plan.h"

namespace autotp {

struct Parameter {
  const PlanEntry* entry = nullptr;  // desc (HF name, shape), role and ShardSpec
  torch::Tensor tensor;              // this rank's shard
  const std::string& name() const { return entry->desc.name; }
  const ShardSpec& spec() const { return entry->spec; }
  bool trains() const { return !entry->frozen; }
};

// Called around every use of parameters (ZeRO-3 gathers in `before_*` and
// releases in `after_*`; ZeRO-2/3 reduce a layer's gradients in
// `after_backward`). Forward: before_forward / after_forward around the use.
// Backward (with autograd on): before_backward before the use's backward
// (ahead of its recomputation when checkpointed) and after_backward once its
// parameter gradients are accumulated. The embeddings' backward reads no
// parameter, so they get no backward calls (their backward ends the pass).
struct UseHooks {
  std::function<void(int64_t)> before_forward, after_forward, before_backward, after_backward;
};

class ShardedModel {
 public:
  // The uses: the embeddings (kEmbeddingUse), each decoder layer (its index) and
  // the head (final norm + LM head, head_use() == num_layers()).
  static constexpr int64_t kEmbeddingUse = -1;

  virtual ~ShardedModel() = default;
  virtual std::vector<Parameter>& parameters() = 0;
  virtual torch::ScalarType dtype() const = 0;
  virtual const torch::Device& device() const = 0;
  virtual int64_t num_layers() const = 0;
  int64_t head_use() const { return num_layers(); }
  // The head's use reads the token embeddings (a tied LM head).
  virtual bool tied_head() const = 0;
  virtual void set_use_hooks(UseHooks hooks) = 0;
};

}  // namespace autotp
