// Small checks the tests share.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <string>

namespace autotp::test {

// The message of the UserError `fn` throws, or "(no error)" when it throws none.
std::string user_error_of(const std::function<void()>& fn);

// max |actual - expected| relative to expected's largest magnitude.
double relative_max_diff(const torch::Tensor& actual, const torch::Tensor& expected);

// Whether a parameter product runs in full (AUTOTP_TEST_FULL=1, tools/test --full)
// or as its pairwise-covering subset (unset or 0). Any other value fails the test
// that asks (docs/testing.md, Subsets).
bool full_products();

}  // namespace autotp::test
