// DivergenceMonitor: a loss above twice the running mean of the last 50 steps,
// and a gradient norm of exactly 0, each warn once when they start.
#include <gtest/gtest.h>

#include "autotp/runtime/divergence_monitor.h"

namespace autotp {
namespace {

TEST(DivergenceMonitor, LossSpikeWarnsWhenItStartsAgainstTheRunningMean) {
  DivergenceMonitor monitor;
  for (int s = 1; s <= 60; ++s) EXPECT_TRUE(monitor.observe(s, 2.0 + 0.01 * (s % 3), 1.0, false).empty()) << s;
  // The mean of the last 50 losses (steps 11-60) is 2.0 + 0.01 * (16 ones + 17 twos) / 50 = 2.01.
  EXPECT_TRUE(monitor.observe(61, 4.0, 1.0, false).empty());  // not above 2 x 2.01
  // Steps 12-61: 2.01 + (4.0 - 2.02) / 50 = 2.0496; 4.2 is above twice that.
  auto warnings = monitor.observe(62, 4.2, 1.0, false);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step 62: loss 4.2000 is above 2 times its mean over the last 50 steps"),
            std::string::npos)
      << warnings[0];
  EXPECT_TRUE(monitor.observe(63, 9.0, 1.0, false).empty());  // still spiking: no second warning
  EXPECT_TRUE(monitor.observe(64, 2.0, 1.0, false).empty());
  EXPECT_EQ(monitor.observe(65, 9.0, 1.0, false).size(), 1u);  // a new spike warns again
}

TEST(DivergenceMonitor, NoSpikeBeforeFiveStepsAndSkippedStepsAreIgnored) {
  DivergenceMonitor monitor;
  EXPECT_TRUE(monitor.observe(1, 1.0, 1.0, false).empty());
  EXPECT_TRUE(monitor.observe(2, 10.0, 1.0, false).empty());  // one step of history is not a mean
  DivergenceMonitor skipping;
  for (int s = 1; s <= 5; ++s) skipping.observe(s, 1.0, 1.0, false);
  EXPECT_TRUE(skipping.observe(6, 100.0, 0.0, true).empty());  // a skipped step says nothing
  EXPECT_EQ(skipping.observe(7, 100.0, 1.0, false).size(), 1u);
}

TEST(DivergenceMonitor, ZeroGradientNormWarnsOncePerRun) {
  DivergenceMonitor monitor;
  EXPECT_TRUE(monitor.observe(1, 5.5, 3.0, false).empty());
  auto warnings = monitor.observe(2, 5.56, 0.0, false);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("step 2: the gradient norm is exactly 0"), std::string::npos) << warnings[0];
  for (int s = 3; s < 10; ++s) EXPECT_TRUE(monitor.observe(s, 5.56, 0.0, false).empty());
  EXPECT_TRUE(monitor.observe(10, 5.5, 1e-3, false).empty());
  EXPECT_EQ(monitor.observe(11, 5.5, 0.0, false).size(), 1u);
}

}  // namespace
}  // namespace autotp
