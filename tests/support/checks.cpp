#include "support/checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

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

bool full_products() {
  const char* value = std::getenv("AUTOTP_TEST_FULL");
  const std::string text = value ? value : "";
  if (text.empty() || text == "0") return false;
  if (text == "1") return true;
  ADD_FAILURE() << "AUTOTP_TEST_FULL='" << text << "' (allowed: 0, 1)";
  return true;
}

}  // namespace autotp::test
