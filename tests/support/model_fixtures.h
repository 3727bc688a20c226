// Helpers that build HF model directories for tests.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>

#include "autotp/comm/topology.h"
#include "autotp/model/presets.h"

namespace autotp::test {

// A fresh empty directory under /tmp (removed by the OS, not by the test).
std::string make_temp_dir(const std::string& tag);

// Writes config.json + model.safetensors into `dir` (created) and returns dir.
std::string write_model_dir(const std::string& dir, const nlohmann::json& config,
                            const std::map<std::string, torch::Tensor>& weights);

// Writes `lines` lines "Line i: <sentence>\n" (i = 0, 1, ...) to `path`: the small
// text corpus of the end-to-end tests. Returns path.
std::string write_line_corpus(const std::string& path, int lines,
                              const std::string& sentence = "the quick brown fox jumps over the lazy dog.");

// The config.json of a built-in preset, optionally with keys overridden.
nlohmann::json preset_config(const std::string& name, const nlohmann::json& overrides = nlohmann::json::object());

// Built-in preset `name` sharded for `topo`'s tp group (the default plan), in
// `dtype`, with weights from `seed`.
std::unique_ptr<CausalLM> sharded_preset(const std::string& name, Topology& topo, torch::ScalarType dtype,
                                         uint64_t seed);

}  // namespace autotp::test
