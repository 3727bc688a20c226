// Precompiled header: the heavy third-party headers every translation unit uses.
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <map>
#include <memory>
#include <string>
#include <vector>
