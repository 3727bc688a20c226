// The one quantile rule of every report (scenario results, bench-step,
// simulate --measured): linear interpolation between the closest ranks, numpy's
// default, so the median of an even count is the mean of the middle two.
#pragma once
#include <vector>

namespace autotp {

// The q-quantile (q in [0, 1]) of `values`; 0 for none.
double quantile(std::vector<double> values, double q);
inline double median(std::vector<double> values) { return quantile(std::move(values), 0.5); }

}  // namespace autotp
