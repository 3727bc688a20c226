#include "support/checks.h"

#include <algorithm>

#include "autotp/base/error.h"

namespace autotp::test {

std::string user_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

double relative_max_diff(const torch::Tensor& actual, const torch::Tensor& expected) {
  const double scale = std::max(expected.abs().max().item<double>(), 1e-30);
  return (actual - expected).abs().max().item<double>() / scale;
}

}  // namespace autotp::test
