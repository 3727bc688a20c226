// Stage3Params: ZeRO-3's parameter manager (the role of DeepSpeed's parameter
// coordinator). Each rank keeps its partition of every unit; a unit is
// all-gathered into its unit buffer right before a use that reads it and its
// storage freed right after (again around its backward); small tensors stay
// whole (the persistent unit, stage3_param_persistence_threshold). With
// prefetch the next use's units are gathered while the current one computes,
// within stage3_max_live_parameters. Units are counted: a unit two uses read
// is freed when the last releases it. With `host_partition` (ZeRO-Offload's
// offload_param) the partition lives in host memory and a gather first copies
// the rank's slice to the device; the persistent unit stays on the device.
#pragma once
#include <map>
#include <vector>

#include "autotp/zero/param_store.h"

namespace autotp {

class Stage3Params : public ParamStore {
 public:
  // `use_units[use + 1]`: the units use `use` reads (use -1: the embeddings).
  // Moves the parameters into their unit buffers unit by unit (each freed once
  // its slice is in the partition, so the whole model never exists twice).
  Stage3Params(HeldParams& held, UnitCollectives& comm, std::vector<std::vector<int>> use_units, bool prefetch,
               int64_t max_live, bool host_partition = false, bool pin = false);
  torch::Tensor at(int64_t begin, int64_t length) const override { return part_.narrow(0, begin, length); }
  torch::Tensor partition(torch::ScalarType dtype) const override {
    return dtype == part_.scalar_type() ? part_ : part_.to(dtype);
  }
  void begin_step() override;
  void after_backward() override { release_stale_units(); }
  void after_update(const torch::Tensor& master) override { redistribute(master); }
  void redistribute(const torch::Tensor& master) override;
  void load(const torch::Tensor& values) override { part_.copy_(values); }
  void acquire_use(int64_t use) override;
  void release_use(int64_t use) override;
  void prefetch_use(int64_t use) override;
  void gather_all() override;
  int64_t bytes() const override;
  int64_t host_bytes() const override { return host_partition_ ? static_cast<int64_t>(part_.nbytes()) : 0; }

 private:
  void acquire_unit(int unit);  // gather (counted), or complete its prefetch
  // If `unit` is being prefetched, completes its gather and holds it once; false otherwise.
  bool take_prefetched(int unit);
  void release_unit(int unit);
  void release_pins();
  void release_stale_units();  // frees units still held outside a use
  bool whole(int unit) const { return unit == held_.layout.whole_unit; }
  torch::Tensor local_slice(int unit) const;  // this rank's slice of `unit`, on the device

  HeldParams& held_;
  UnitCollectives& comm_;
  std::vector<std::vector<int>> use_units_;
  bool prefetch_;
  int64_t max_live_;
  bool host_partition_;  // prefetch only while the gathered elements stay within this
  torch::Tensor part_;                       // this rank's partition
  std::vector<torch::Tensor> unit_buffers_;  // per unit, its whole buffer (storage freed when released)
  std::vector<int> gathered_;                // holders per unit
  bool pinned_ = false;                      // gather_all holds every unit
  std::map<int, InFlight> prefetched_;       // units being gathered ahead of their use
};

}  // namespace autotp
