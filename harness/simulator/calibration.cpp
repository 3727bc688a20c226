#include "simulator/calibration.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include "autotp/base/bf16_matmul.h"
#include "autotp/comm/dist_env.h"
#include "autotp/comm/process_group.h"
#include "autotp/comm/topology.h"
#include "autotp/optim/grad_norm.h"
#include "autotp/base/device.h"
#include "autotp/model/causal_lm.h"
#include "autotp/model/presets.h"
#include "autotp/optim/optimizer.h"
#include "autotp/base/error.h"
#include "autotp/base/host_cpu.h"
#include "autotp/base/json_file.h"
#include "autotp/base/log.h"
#include "autotp/base/quantile.h"
#include "autotp/zero/flat_layout.h"
#include "simulator/cluster_catalog.h"
#include "simulator/memory_model.h"
#include "simulator/model_catalog.h"
#include "simulator/op_count.h"
#include "simulator/rank_shape.h"
#include "simulator/time_model.h"

namespace autotp::sim {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

json cost_json(const LinearCost& c) { return {{"latency_s", c.latency_s}, {"rate", c.rate}}; }

LinearCost cost_from(const json& j, const std::string& where, const std::string& source) {
  AUTOTP_USER_CHECK(j.is_object() && j.contains("latency_s") && j.contains("rate") && j["rate"].is_number() &&
                        j["rate"].get<double>() > 0,
                    "{}: '{}' must be {{\"latency_s\": s, \"rate\": r > 0}}", source, where);
  return {j["latency_s"].get<double>(), j["rate"].get<double>()};
}

std::map<int, LinearCost> costs_from(const json& j, const std::string& where, const std::string& source) {
  std::map<int, LinearCost> out;
  if (!j.is_object()) return out;
  for (const auto& [key, value] : j.items()) out[std::stoi(key)] = cost_from(value, where + "." + key, source);
  return out;
}

// {"<group size>": a number >= 0 (a share or seconds), ...}; absent (older files) is empty.
std::map<int, double> nonnegative_by_group(const json& j, const std::string& key, const std::string& source) {
  std::map<int, double> out;
  if (!j.contains(key) || !j[key].is_object()) return out;
  for (const auto& [size, value] : j[key].items()) {
    AUTOTP_USER_CHECK(value.is_number() && value.get<double>() >= 0, "{}: '{}.{}' must be a number >= 0", source,
                      key, size);
    out[std::stoi(size)] = value.get<double>();
  }
  return out;
}

int64_t mem_total_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemTotal:") return kb * 1024;
  return 0;
}

// Seconds per call of `fn`: the mean over at least `seconds` (and 3 calls). A mean,
// not a best-of, because the simulator predicts a typical step: the host's share
// of the CPU is taken out separately (StealWindow), the rest of the noise is the machine's.
// On a GPU every call is followed by a synchronisation (the times are the GPU's
// work, not its launch); a no-op on CPU.
torch::Device g_device = torch::kCPU;

template <typename Fn>
double time_call(Fn&& fn, double seconds) {
  fn();  // warm-up
  synchronize(g_device);
  int64_t calls = 0;
  auto start = Clock::now();
  double elapsed = 0;
  do {
    fn();
    synchronize(g_device);
    ++calls;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (calls < 3 || elapsed < seconds);
  return elapsed / calls;
}

// The median call of `fn` over at least `seconds` and `min_calls` calls: a step's
// calls on this machine vary by 15% with a long slow tail (another tenant, page
// faults), which a mean over a few calls catches at random; training runs are
// compared by their median step.
template <typename Fn>
double median_call(Fn&& fn, double seconds, int min_calls) {
  fn();  // warm-up
  synchronize(g_device);
  std::vector<double> calls;
  const auto start = Clock::now();
  do {
    const auto call = Clock::now();
    fn();
    synchronize(g_device);
    calls.push_back(std::chrono::duration<double>(Clock::now() - call).count());
  } while (static_cast<int>(calls.size()) < min_calls ||
           std::chrono::duration<double>(Clock::now() - start).count() < seconds);
  return median(calls);
}

// The median of `calls` calls of `fn` (no warm-up: with collectives every rank must
// make the same number of calls).
template <typename Fn>
double median_of_calls(Fn&& fn, int calls) {
  std::vector<double> each;
  for (int i = 0; i < calls; ++i) {
    const auto start = Clock::now();
    fn();
    synchronize(g_device);
    each.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return median(each);
}

// Collectives: every rank must make the same number of calls, so the count is fixed.
template <typename Fn>
double time_calls(Fn&& fn, int calls) {
  fn();
  synchronize(g_device);
  auto start = Clock::now();
  for (int i = 0; i < 2 * calls; ++i) fn();
  synchronize(g_device);
  return std::chrono::duration<double>(Clock::now() - start).count() / (2 * calls);
}

// Calibration times are scaled to a host that takes no CPU from this machine:
// times the share of the wanted CPU time it got while they were measured
// (1 - steal fraction). A run's steal is put back when it is simulated
// (ClusterSpec::host_steal_fraction).
class StealWindow {
 public:
  double kept_share() const { return 1 - steal_fraction(from_, host_cpu_times()); }

 private:
  HostCpuTimes from_ = host_cpu_times();
};

std::vector<double> scaled(std::vector<double> seconds, double share) {
  for (double& x : seconds) x *= share;
  return seconds;
}

}  // namespace

LinearCost fit_linear_cost(const std::vector<double>& x, const std::vector<double>& y) {
  // Weighted least squares on relative error (weights 1/y^2) so small sizes fit the latency.
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = 1.0 / (y[i] * y[i]);
    sw += w;
    sx += w * x[i];
    sy += w * y[i];
    sxx += w * x[i] * x[i];
    sxy += w * x[i] * y[i];
  }
  const double det = sw * sxx - sx * sx;
  double beta = det != 0 ? (sw * sxy - sx * sy) / det : 0;
  double alpha = sw != 0 ? (sy - beta * sx) / sw : 0;
  if (alpha < 0) {  // through the origin
    alpha = 0;
    beta = sxx != 0 ? sxy / sxx : 0;
  }
  if (beta <= 0) {  // flat: all latency; any positive rate keeps the formula defined
    double largest = 1;
    for (double v : x) largest = std::max(largest, v);
    beta = 1e-9 * alpha / largest;
  }
  LinearCost c;
  c.latency_s = alpha;
  c.rate = beta > 0 ? 1.0 / beta : 1e30;
  return c;
}

double Calibration::slowdown(int ranks) const {
  if (world <= 1 || ranks <= 1) return 1;
  const double contention = concurrency_slowdown / oversubscription(world);
  return oversubscription(ranks) * (1 + (contention - 1) * (ranks - 1) / (world - 1));
}

double Calibration::oversubscription(int ranks) const {
  return std::max(1.0, static_cast<double>(ranks) * std::max(1, threads_per_rank) / std::max(1, cores));
}

double Calibration::skew_share(int ranks) const {
  const double measured = oversubscription(world) - 1;
  return measured > 0 ? (oversubscription(ranks) - 1) / measured : 0.0;
}

const char* dtype_label(torch::ScalarType t) {
  return t == torch::kFloat32 ? "fp32" : t == torch::kBFloat16 ? "bf16" : "fp16";
}

std::string default_calibration_path() {
  const char* env = std::getenv("AUTOTP_CALIBRATION");
  return env && *env ? env : "reports/calibration/cpu-local.json";
}

namespace {

// A ComputeCosts' keys, at the top level of the file for the calibration dtype
// and under "other_dtypes"."<dtype>" for the other.
void put_compute(json& j, const ComputeCosts& costs) {
  json gemm = json::array();
  for (const auto& [s, seconds] : costs.gemm_seconds)
    gemm.push_back({{"m", s.m}, {"k", s.k}, {"n", s.n}, {"batch", s.batch}, {"seconds", seconds},
                    {"flops_per_s", s.flops() / seconds}});
  j["gemm"] = gemm;
  j["gemm_fit"] = cost_json(costs.gemm_fit);
  j["gemm_peak_flops"] = costs.gemm_peak_flops;
  j["elementwise"] = {{"forward", cost_json(costs.elementwise_forward)},
                      {"forward_grad", cost_json(costs.elementwise_forward_grad)},
                      {"forward_backward", cost_json(costs.elementwise_forward_backward)}};
}

ComputeCosts compute_from(const json& j, const std::string& where, const std::string& source) {
  ComputeCosts c;
  try {
    for (const auto& g : j.at("gemm")) {
      GemmShape s{g.at("m").get<int64_t>(), g.at("k").get<int64_t>(), g.at("n").get<int64_t>(),
                  g.at("batch").get<int64_t>()};
      c.gemm_seconds[s] = g.at("seconds").get<double>();
    }
    c.gemm_peak_flops = j.at("gemm_peak_flops").get<double>();
  } catch (const json::exception& e) {
    throw_user_error("{}: malformed calibration{} ({})", source, where, e.what());
  }
  AUTOTP_USER_CHECK(c.gemm_peak_flops > 0, "{}: {}gemm_peak_flops must be positive", source, where);
  c.gemm_fit = cost_from(j.value("gemm_fit", json()), where + "gemm_fit", source);
  const json& e = j.value("elementwise", json::object());
  c.elementwise_forward = cost_from(e.value("forward", json()), where + "elementwise.forward", source);
  c.elementwise_forward_grad = cost_from(e.value("forward_grad", json()), where + "elementwise.forward_grad", source);
  c.elementwise_forward_backward =
      cost_from(e.value("forward_backward", json()), where + "elementwise.forward_backward", source);
  return c;
}

// Index of the largest grid point <= x (clamped) and x's position between it and the next, in log space.
std::pair<size_t, double> grid_position(int64_t x) {
  constexpr size_t n = std::size(kGemmGrid);
  if (x <= kGemmGrid[0]) return {0, 0.0};
  if (x >= kGemmGrid[n - 1]) return {n - 2, 1.0};
  size_t i = 0;
  while (kGemmGrid[i + 1] < x) ++i;
  const double t = std::log(static_cast<double>(x) / kGemmGrid[i]) /
                   std::log(static_cast<double>(kGemmGrid[i + 1]) / kGemmGrid[i]);
  return {i, t};
}

}  // namespace

double ComputeCosts::gemm(const GemmShape& shape) const {
  if (auto it = gemm_seconds.find(shape); it != gemm_seconds.end()) return it->second;
  // The grid's log FLOP rate, interpolated in (log m, log k, log n); a batch runs as that many GEMMs.
  const auto [im, tm] = grid_position(shape.m);
  const auto [ik, tk] = grid_position(shape.k);
  const auto [in, tn] = grid_position(shape.n);
  double log_rate = 0;
  for (int corner = 0; corner < 8; ++corner) {
    const int dm = corner & 1, dk = (corner >> 1) & 1, dn = (corner >> 2) & 1;
    const GemmShape at{kGemmGrid[im + dm], kGemmGrid[ik + dk], kGemmGrid[in + dn], 1};
    auto it = gemm_seconds.find(at);
    if (it == gemm_seconds.end()) return gemm_fit.seconds(shape.flops());  // an older file: no grid
    const double weight = (dm ? tm : 1 - tm) * (dk ? tk : 1 - tk) * (dn ? tn : 1 - tn);
    log_rate += weight * std::log(at.flops() / it->second);
  }
  const GemmShape one{shape.m, shape.k, shape.n, 1};
  return static_cast<double>(shape.batch) * one.flops() / std::exp(log_rate);
}

const ComputeCosts& Calibration::costs_for(const std::string& dtype_name) const {
  if (dtype_name == dtype) return compute;
  auto it = other_dtypes.find(dtype_name);
  return it != other_dtypes.end() ? it->second : compute;
}

json Calibration::to_json() const {
  json reduce = json::object(), gather = json::object(), overhead = json::object();
  for (const auto& [n, c] : all_reduce) reduce[std::to_string(n)] = cost_json(c);
  for (const auto& [n, s] : overhead_ratio_by_tp) overhead[std::to_string(n)] = s;
  for (const auto& [n, c] : all_gather) gather[std::to_string(n)] = cost_json(c);
  json after_compute = json::object(), between_layers = json::object();
  for (const auto& [n, s] : step_collective_skew) after_compute[std::to_string(n)] = s;
  for (const auto& [n, s] : layer_gather_skew) between_layers[std::to_string(n)] = s;
  json wake = json::object();
  for (const auto& [n, s] : collective_wake_s) wake[std::to_string(n)] = s;
  json j = {{"format", "autotp-calibration-1"},
            {"world", world},
            {"threads_per_rank", threads_per_rank},
            {"cores", cores},
            {"model", model},
            {"device", device},
            {"dtype", dtype},
            {"micro_batch", micro_batch},
            {"seq_len", seq_len},
            {"memory_bytes", memory_bytes},
            {"overhead_ratio", overhead_ratio},
            {"overhead_ratio_by_tp", overhead},
            {"concurrency_slowdown", concurrency_slowdown},
            {"step_collective_skew", after_compute},
            {"layer_gather_skew", between_layers},
            {"collective_wake_s", wake},
            {"host_steal_fraction", host_steal_fraction},
            {"optimizer_step", optimizer_step ? cost_json(*optimizer_step) : json()},
            {"dispatch_op_s", dispatch_op_s ? json(*dispatch_op_s) : json()},
            {"cpu_adam_bytes_per_core_s", cpu_adam_bytes_per_core_s ? json(*cpu_adam_bytes_per_core_s) : json()},
            {"all_reduce", reduce},
            {"all_gather", gather}};
  put_compute(j, compute);
  json others = json::object();
  for (const auto& [name, costs] : other_dtypes) put_compute(others[name], costs);
  j["other_dtypes"] = others;
  return j;
}

Calibration Calibration::from_json(const json& j, const std::string& source) {
  AUTOTP_USER_CHECK(j.is_object() && j.value("format", "") == "autotp-calibration-1",
                    "{}: not an autotp calibration file (expected \"format\": \"autotp-calibration-1\"; make one with "
                    "`autotp simulate --calibrate`)",
                    source);
  Calibration c;
  try {
    c.world = j.at("world").get<int>();
    c.threads_per_rank = j.at("threads_per_rank").get<int>();
    c.cores = j.at("cores").get<int>();
    c.model = j.value("model", "");
    c.device = j.value("device", std::string("cpu"));
    c.dtype = j.value("dtype", std::string("fp32"));
    c.micro_batch = j.value("micro_batch", int64_t{0});
    c.seq_len = j.value("seq_len", int64_t{0});
    c.memory_bytes = j.at("memory_bytes").get<int64_t>();
    c.overhead_ratio = j.value("overhead_ratio", 0.0);
    c.concurrency_slowdown = j.value("concurrency_slowdown", 1.0);
    c.host_steal_fraction = j.value("host_steal_fraction", 0.0);
  } catch (const json::exception& e) {
    throw_user_error("{}: malformed calibration ({})", source, e.what());
  }
  c.compute = compute_from(j, "", source);
  if (j.contains("other_dtypes") && j["other_dtypes"].is_object())
    for (const auto& [name, costs] : j["other_dtypes"].items())
      c.other_dtypes[name] = compute_from(costs, "other_dtypes." + name + ".", source);
  // Older files' fitted seconds (layer_overhead_s, step_collective_extra_s, ...) are not read.
  c.overhead_ratio_by_tp = nonnegative_by_group(j, "overhead_ratio_by_tp", source);
  c.step_collective_skew = nonnegative_by_group(j, "step_collective_skew", source);
  c.layer_gather_skew = nonnegative_by_group(j, "layer_gather_skew", source);
  c.collective_wake_s = nonnegative_by_group(j, "collective_wake_s", source);
  AUTOTP_USER_CHECK(c.overhead_ratio >= 0, "{}: 'overhead_ratio' must be >= 0", source);
  if (j.contains("optimizer_step") && !j["optimizer_step"].is_null()) c.optimizer_step = cost_from(j["optimizer_step"], "optimizer_step", source);
  if (j.contains("dispatch_op_s") && !j["dispatch_op_s"].is_null()) {
    const json& d = j["dispatch_op_s"];
    AUTOTP_USER_CHECK(d.is_number() && d.get<double>() >= 0, "{}: 'dispatch_op_s' must be seconds >= 0", source);
    c.dispatch_op_s = d.get<double>();
  }
  if (j.contains("cpu_adam_bytes_per_core_s") && !j["cpu_adam_bytes_per_core_s"].is_null()) {
    const json& rate = j["cpu_adam_bytes_per_core_s"];
    AUTOTP_USER_CHECK(rate.is_number() && rate.get<double>() > 0,
                      "{}: 'cpu_adam_bytes_per_core_s' must be bytes per second > 0", source);
    c.cpu_adam_bytes_per_core_s = rate.get<double>();
  }
  c.all_reduce = costs_from(j.value("all_reduce", json::object()), "all_reduce", source);
  c.all_gather = costs_from(j.value("all_gather", json::object()), "all_gather", source);
  AUTOTP_USER_CHECK(c.world >= 1, "{}: world must be positive", source);
  AUTOTP_USER_CHECK(c.concurrency_slowdown >= 1, "{}: concurrency_slowdown must be >= 1 (got {})", source,
                    c.concurrency_slowdown);
  return c;
}

Calibration Calibration::from_file(const std::string& path) {
  return from_json(read_json_file(path, "calibration file"), path);
}

namespace {

std::vector<double> to_vector(const torch::Tensor& t) {
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// Seconds per call that a variant takes beyond its base, and base's seconds per call.
struct Extra {
  double base_s = 0, extra_s = 0;
};

// This rank's part in the calibrating world: the world's group (none when alone)
// and how the ranks agree on what they measured.
struct Session {
  Session(const DistEnv& dist_env, const CalibrationOptions& calibration_options)
      : env(dist_env),
        options(calibration_options),
        on(torch::TensorOptions().device(calibration_options.device)),
        measures(dist_env.rank == 0) {
    if (env.world_size > 1) {
      store = create_tcp_store(env);
      world = Topology::create_with_store(prefix_store("calibration_world", store), env.rank, env.world_size,
                                          {});
    }
  }

  void barrier() const {
    if (world) world->world().barrier();
  }
  // Every rank's seconds averaged over the world (the ranks ran at the same time).
  std::vector<double> average(std::vector<double> seconds) const {
    if (!world) return seconds;
    auto t = torch::tensor(seconds, torch::kFloat64);
    world->world().all_reduce(t);
    return to_vector(t.div_(env.world_size));
  }
  std::vector<double> from_rank0(std::vector<double> seconds) const {
    if (!world) return seconds;
    auto t = torch::tensor(seconds, torch::kFloat64);
    world->world().broadcast(t, 0);
    return to_vector(t);
  }
  // Seconds per call of `fn` with every rank calling it at once, the same number of
  // times (it may hold collectives): the world's mean of each rank's median call of
  // 3 x `calls`, unstolen.
  double concurrent_seconds(const std::function<void()>& fn, int calls) const {
    fn();  // warm-up
    barrier();
    StealWindow window;
    const double seconds = median_of_calls(fn, 3 * calls);
    return average({seconds * window.kept_share()})[0];
  }
  // Seconds per call that `variant` takes beyond `base`, both run by every rank at
  // once: alternating rounds of `calls` calls each, so that the machine's drift over
  // the measurement falls on both alike. Also returns base's seconds per call.
  Extra concurrent_extra(const std::function<void()>& base, const std::function<void()>& variant,
                         int calls) const {
    base();  // warm-up
    variant();
    barrier();
    double base_s = 0, variant_s = 0;
    auto timed = [&](const std::function<void()>& fn) {
      StealWindow window;
      auto start = Clock::now();
      for (int i = 0; i < calls; ++i) fn();
      synchronize(g_device);
      return std::chrono::duration<double>(Clock::now() - start).count() * window.kept_share();
    };
    constexpr int kRounds = 6;
    for (int round = 0; round < kRounds; ++round) {
      base_s += timed(base);
      variant_s += timed(variant);
    }
    auto mean = average({base_s / (kRounds * calls), variant_s / (kRounds * calls)});
    return Extra{mean[0], mean[1] - mean[0]};
  }

  // `variant`'s seconds per call over `base`'s, both run by every rank at once: the
  // median over alternating rounds of `calls` calls each, every round started at a
  // barrier so that no rank runs one while another runs the other (the machine's
  // drift, a steady share of it, falls on both alike). Also returns base's seconds
  // per call (the mean over the rounds).
  struct Ratio {
    double base_s = 0, ratio = 1;
  };
  Ratio concurrent_ratio(const std::function<void()>& base, const std::function<void()>& variant, int calls,
                         int rounds) const {
    base();  // warm-up
    variant();
    auto timed = [&](const std::function<void()>& fn) {  // the round's median call
      barrier();
      StealWindow window;
      const double seconds = median_of_calls(fn, calls);
      return seconds * window.kept_share();
    };
    std::vector<double> ratios;
    Ratio r;
    for (int round = 0; round < rounds; ++round) {
      const double b = timed(base), v = timed(variant);
      const auto m = average({b, v});
      ratios.push_back(m[1] / m[0]);
      r.base_s += m[0] / rounds;
    }
    r.ratio = median(ratios);
    return r;
  }

  const DistEnv env;
  const CalibrationOptions& options;
  const torch::TensorOptions on;       // where the measured tensors live (fp32: collectives, optimizer)
  // Compute costs are rank 0's, measured while the other ranks wait in from_rank0's broadcast.
  const bool measures;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<Topology> world;  // null when alone
};

// What the calibration was made on and for, before anything is measured.
Calibration describe_machine(const DistEnv& env, const CalibrationOptions& options) {
  Calibration cal;
  cal.world = env.world_size;
  cal.threads_per_rank = at::get_num_threads();
  cal.cores = static_cast<int>(std::thread::hardware_concurrency());
  cal.model = options.model;
  cal.micro_batch = options.micro_batch;
  cal.seq_len = options.seq_len;
  cal.memory_bytes = mem_total_bytes();
  cal.device = options.device.is_cuda() ? "cuda" : "cpu";
  cal.dtype = dtype_label(options.dtype);
  return cal;
}

// GEMMs at the step shapes of the model at every tp that fits the world.
std::vector<GemmShape> gemm_shapes(const Session& session, const ModelConfig& config) {
  const int world_size = session.env.world_size;
  std::set<GemmShape> shapes;
  for (int tp = 1; tp <= world_size; ++tp) {
    if (world_size % tp != 0 || tp > config.num_heads) continue;
    auto plan = build_plan(config, tp);
    SimLayout layout;
    layout.gpus = world_size;
    layout.tp = tp;
    layout.micro_batch = session.options.micro_batch;
    layout.seq_len = session.options.seq_len;
    for (int r = 0; r < tp; ++r)
      for (const auto& [shape, count] : step_gemms(config, rank_shape(config, plan, r), layout))
        shapes.insert(shape);
  }
  // The grid every calibration times, whatever the model: other models' shapes are priced from it.
  for (int64_t m : kGemmGrid)
    for (int64_t k : kGemmGrid)
      for (int64_t n : kGemmGrid) shapes.insert(GemmShape{m, k, n, 1});
  return std::vector<GemmShape>(shapes.begin(), shapes.end());
}

// Rank 0's seconds at each shape in `dtype` (the others wait), and the fit over them.
void measure_gemms(const Session& session, const ModelConfig& config, torch::ScalarType dtype, ComputeCosts& cal) {
  const auto on = session.on.dtype(dtype);
  const std::vector<GemmShape> list = gemm_shapes(session, config);
  std::vector<double> gemm_times;
  StealWindow gemm_window;
  for (const auto& s : list) {
    if (!session.measures) {
      gemm_times.push_back(0);
      continue;
    }
    auto a = s.batch > 1 ? torch::randn({s.batch, s.m, s.k}, on) : torch::randn({s.m, s.k}, on);
    auto b = s.batch > 1 ? torch::randn({s.batch, s.k, s.n}, on) : torch::randn({s.k, s.n}, on);
    gemm_times.push_back(time_call([&] { matmul_nograd(a, b); }, session.options.seconds_per_point));  // the engine's product
  }
  gemm_times = session.from_rank0(scaled(gemm_times, gemm_window.kept_share()));
  std::vector<double> flops;
  for (size_t i = 0; i < list.size(); ++i) {
    cal.gemm_seconds[list[i]] = gemm_times[i];
    flops.push_back(list[i].flops());
    cal.gemm_peak_flops = std::max(cal.gemm_peak_flops, list[i].flops() / gemm_times[i]);
  }
  cal.gemm_fit = fit_linear_cost(flops, gemm_times);
}

// Elementwise ops in `dtype`: forward, forward under autograd, forward + backward.
void measure_elementwise(const Session& session, torch::ScalarType dtype, ComputeCosts& cal) {
  const auto on = session.on.dtype(dtype);
  const double element_size = static_cast<double>(c10::elementSize(dtype));
  const double seconds_per_point = session.options.seconds_per_point;
  const std::vector<int64_t> sizes = {256, 4096, 65536, 1 << 20};
  std::vector<double> bytes, fwd, fwd_grad, fb;
  StealWindow elementwise_window;
  for (int64_t n : sizes) {
    bytes.push_back(3.0 * n * element_size);
    if (!session.measures) {
      fwd.push_back(0), fwd_grad.push_back(0), fb.push_back(0);
      continue;
    }
    auto x = torch::randn({n}, on), w = torch::randn({n}, on);
    auto xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    auto g = torch::ones({n}, on);
    fwd.push_back(time_call([&] { torch::mul(x, w); }, seconds_per_point));
    torch::AutoGradMode on(true);
    fwd_grad.push_back(time_call([&] { torch::mul(xg, wg); }, seconds_per_point));
    fb.push_back(time_call(
        [&] {
          xg.mutable_grad() = torch::Tensor();
          wg.mutable_grad() = torch::Tensor();
          torch::mul(xg, wg).backward(g);
        },
        seconds_per_point));
  }
  const double elementwise_share = elementwise_window.kept_share();
  fwd = session.from_rank0(scaled(fwd, elementwise_share));
  fwd_grad = session.from_rank0(scaled(fwd_grad, elementwise_share));
  fb = session.from_rank0(scaled(fb, elementwise_share));
  cal.elementwise_forward = fit_linear_cost(bytes, fwd);
  cal.elementwise_forward_grad = fit_linear_cost(bytes, fwd_grad);
  cal.elementwise_forward_backward = fit_linear_cost(bytes, fb);
}

// The framework's fixed cost per dispatched op: the calibration model's narrow
// copy (the same ops on tensors of a few elements, so its time is the
// framework's), forward + backward timed, over the ops and nodes it dispatches.
// Sampled in windows before, amid and after the rest, and the median of all
// their calls kept: here its half-second medians move between 8 and 16 us per op
// from one second to the next, so one short window priced a whole run's ops at
// whichever second it caught (docs/simulator.md, "cpu-local calibration").
struct DispatchSamples {
  DispatchSamples(const Session& session, const ModelConfig& config)
      : window(std::max(0.5, 4 * session.options.seconds_per_point)) {
    if (!session.measures || session.options.device.is_cuda()) return;  // GPU ops run behind their launch
    SimLayout layout;
    layout.gpus = 1;
    layout.micro_batch = session.options.micro_batch;
    layout.seq_len = session.options.seq_len;
    layout.dtype = session.options.dtype;
    step = std::make_unique<NarrowStep>(config, layout);
    const OpCounts counts = count_ops([&] { step->run(); });
    ops = counts.ops + counts.nodes;
  }
  void sample() {
    if (!step) return;
    StealWindow steal;
    std::vector<double> window_calls;
    const auto start = Clock::now();
    do {
      const auto call = Clock::now();
      step->run();
      window_calls.push_back(std::chrono::duration<double>(Clock::now() - call).count());
    } while (std::chrono::duration<double>(Clock::now() - start).count() < window);
    for (double c : window_calls) calls.push_back(c * steal.kept_share());
  }
  void store(const Session& session, Calibration& cal) const {
    if (session.options.device.is_cuda()) return;
    cal.dispatch_op_s = session.from_rank0({step ? median(calls) / ops : 0.0})[0];
  }
  const double window;
  std::unique_ptr<NarrowStep> step;  // rank 0's, on the CPU
  double ops = 0;
  std::vector<double> calls;  // seconds per forward + backward, every window's
};

// The optimizer step on partitions up to the model's size, as ZeroOptimizer::step runs it.
void measure_optimizer_step(const Session& session, const ModelConfig& config, Calibration& cal) {
  const auto& on = session.on;
  const int64_t total = std::max<int64_t>(4096, count_parameters(config));
  std::vector<double> elements, seconds;
  StealWindow optimizer_window;
  for (int64_t n : {total / 8, total / 4, total / 2, total}) {
    elements.push_back(static_cast<double>(n));
    if (!session.measures) {
      seconds.push_back(0);
      continue;
    }
    OptimizerConfig adamw;
    adamw.weight_decay = 0.01;
    FlatOptimizer optimizer(adamw, n, session.options.device);
    auto params = torch::randn({n}, on), grads = torch::randn({n}, on);
    seconds.push_back(time_call(
        [&] {
          const double norm = std::sqrt(sum_of_squares(grads).item<double>());  // as PartitionNorm
          grads.mul_(std::min(1.0, 1.0 / (norm + 1e-6)));
          optimizer.step(params, grads, 1e-3);
        },
        session.options.seconds_per_point));
  }
  seconds = session.from_rank0(scaled(seconds, optimizer_window.kept_share()));
  cal.optimizer_step = fit_linear_cost(elements, seconds);
}

// ZeRO-Offload's host optimizer: FlatOptimizer::step (at::_fused_adamw_) on fp32
// CPU tensors of 32 Mi elements (512 MiB with the moments: past any cache), with
// this rank's threads; bytes per second per thread, 28 bytes per element.
void measure_cpu_adam(const Session& session, Calibration& cal) {
  constexpr int64_t n = int64_t{1} << 25;
  StealWindow window;
  double seconds = 0;
  if (session.measures) {
    OptimizerConfig adamw;
    adamw.weight_decay = 0.01;
    FlatOptimizer optimizer(adamw, n, torch::kCPU);
    auto params = torch::randn({n}), grads = torch::randn({n});
    const double was = session.options.seconds_per_point;
    seconds = time_call([&] { optimizer.step(params, grads, 1e-3); }, std::max(0.2, was));
  }
  seconds = session.from_rank0(scaled({seconds}, window.kept_share()))[0];
  cal.cpu_adam_bytes_per_core_s = 28.0 * static_cast<double>(n) / seconds / std::max(1, cal.threads_per_rank);
}

// The model's forward + backward at tp 1 (no communication): rank 0 alone against
// the costs measured above gives the framework overhead per layer; every rank at
// once gives the concurrency slowdown. Both are sampled at the start and again
// after the collectives (a shared machine drifts), and averaged.
struct Tp1Step {
  Tp1Step(const ModelConfig& config, const CalibrationOptions& options)
      : plan(build_plan(config, 1)),
        shape(rank_shape(config, plan, 0)),
        lm(config, plan, self, options.dtype, options.device),
        window(std::max(0.5, 10 * options.seconds_per_point)) {
    lm.init_random(1);
    ids = torch::randint(0, config.vocab_size, {options.micro_batch, options.seq_len}, torch::kLong);
  }

  void run() {
    torch::AutoGradMode on(true);
    lm.token_losses(ids, ids).sum().backward();
  }
  void sample_alone(const Session& session) {
    StealWindow alone_window;
    std::vector<double> measured = {session.measures ? median_call([&] { run(); }, window, 7) : 0.0};
    alone_samples.push_back(session.from_rank0(scaled(measured, alone_window.kept_share()))[0]);
  }
  Comm self;
  const TpPlan plan;
  const RankShape shape;
  CausalLM lm;
  torch::Tensor ids;
  const double window;
  std::vector<double> alone_samples, concurrent_samples;
};

// Back-to-back all-reduce and all-gather over the tp groups of size g, world / g groups at once.
void measure_collectives(const Session& session, Topology& topo, int g, Calibration& cal) {
  const auto& on = session.on;
  // Up to 32 MB: a ZeRO unit or a model-sized gradient bucket is past the caches,
  // where the transports copy at memory speed (extrapolating from 4 MB put a
  // llama-100m ZeRO-3 step's gathers at an eighth of what they take).
  const std::vector<int64_t> message = {64, 4096, 65536, 1 << 19, 1 << 22, 1 << 25};
  std::vector<double> x, reduce, gather_bytes, gather;
  StealWindow collectives_window;
  for (int64_t b : message) {
    auto t = torch::ones({std::max<int64_t>(1, b / 4)}, on);
    auto local = torch::ones({std::max<int64_t>(1, b / 4 / g)}, on);
    const int calls = b >= (1 << 25) ? 2 : b >= (1 << 22) ? 5 : b >= (1 << 19) ? 10 : 40;
    session.barrier();
    reduce.push_back(time_calls([&] { topo.tp().all_reduce(t); }, calls));
    session.barrier();
    gather.push_back(time_calls([&] { topo.tp().all_gather(local, 0); }, calls));
    x.push_back(static_cast<double>(t.numel()) * 4);
    gather_bytes.push_back(static_cast<double>(local.numel()) * 4 * g);
  }
  const double collectives_share = collectives_window.kept_share();
  reduce = session.average(scaled(reduce, collectives_share));
  gather = session.average(scaled(gather, collectives_share));
  cal.all_reduce[g] = fit_linear_cost(x, reduce);
  cal.all_gather[g] = fit_linear_cost(gather_bytes, gather);
}

// A tiny all-reduce over the groups of size g after a very short GEMM (tens of us),
// against the GEMM alone, every rank at once: what a lock-step collective costs
// beyond its back-to-back fit when the ranks do something between calls. Longer
// work between collectives waits longer for a descheduled partner (about a tenth
// of the work at 2-20 ms): that part scales with the compute and is the tp step's
// overhead ratio, fitted after this floor.
void measure_collective_wake(const Session& session, Topology& topo, int g, Calibration& cal) {
  auto a = torch::randn({96, 96}, session.on), b = torch::randn({96, 96}, session.on);
  auto small = torch::ones({16}, session.on);
  const Extra wake = session.concurrent_extra([&] { torch::mm(a, b); },
                                              [&] {
                                                torch::mm(a, b);
                                                topo.tp().all_reduce(small);
                                              },
                                              100);
  cal.collective_wake_s[g] = std::max(0.0, wake.extra_s - cal.all_reduce[g].seconds(64));
}

// A forward + backward whose dp group is `group` (g ranks), with the ZeRO-3 cut
// of its local parameters over that group.
struct GroupStep {
  Comm& group;
  int g;
  CausalLM& lm;
  const RankShape& shape;
  const FlatLayout& flat;
  std::function<void()> step;
  int round_calls;
};

// ZeRO-1's model-sized all-reduce (gradients) and all-gather (parameters) after
// the step, per collective beyond the back-to-back fits.
Extra measure_step_collective_extra(const Session& session, const GroupStep& gs, Calibration& cal) {
  const auto& on = session.on;
  const int g = gs.g;
  const int64_t padded = gs.flat.padded;
  auto grads = torch::ones({padded}, on), share = torch::ones({gs.flat.part}, on);
  const Extra dp = session.concurrent_extra(
      gs.step,
      [&] {
        gs.step();
        torch::NoGradGuard no_grad;
        gs.group.all_reduce(grads);
        gs.group.all_gather(share, 0);
      },
      gs.round_calls);
  const double back_to_back =
      cal.all_reduce[g].seconds(4.0 * padded) + cal.all_gather[g].seconds(4.0 * padded);
  cal.step_collective_skew[g] = std::max(0.0, (dp.extra_s - back_to_back) / 2) / dp.base_s;
  return dp;
}

// Each layer's ZeRO-3 gather before the layer runs (twice: forward and
// recomputation), per gather beyond the back-to-back fit.
void measure_layer_gather_extra(const Session& session, const ModelConfig& config, const GroupStep& gs,
                                Calibration& cal) {
  const auto& on = session.on;
  const int g = gs.g;
  std::vector<std::vector<int64_t>> sizes;
  std::vector<torch::Tensor> shares;
  double layer_back_to_back = 0;
  for (const FlatRange& r : gs.shape.layer_ranges) {
    // Each layer is its own unit, cut evenly over the group (flat_layout.h).
    const std::vector<int64_t> extents(g, (r.end - r.begin + g - 1) / g);
    shares.push_back(torch::ones({extents[gs.group.rank()]}, on));
    sizes.push_back(extents);
    layer_back_to_back += 2 * cal.all_gather[g].seconds(4 * zero3_gather_elements(r, gs.flat.padded, g));
  }
  // Layers recompute in both runs (the calibrated ZeRO-3 step checkpoints every layer).
  UseHooks no_gather, gather;
  auto gather_layer = [&](int64_t use) {
    if (use < 0 || use >= static_cast<int64_t>(shares.size())) return;
    torch::NoGradGuard no_grad;
    gs.group.all_gather(shares[use], 0, sizes[use]);
  };
  gather.before_forward = gather_layer;
  gather.before_backward = gather_layer;
  CausalLM& lm = gs.lm;
  lm.set_activation_checkpointing(std::vector<bool>(config.num_layers, true));
  const Extra layers = session.concurrent_extra(
      [&] {
        lm.set_use_hooks(no_gather);
        gs.step();
      },
      [&] {
        lm.set_use_hooks(gather);
        gs.step();
      },
      gs.round_calls);
  lm.set_use_hooks({});
  lm.set_activation_checkpointing({});
  cal.layer_gather_skew[g] = std::max(0.0, layers.extra_s - layer_back_to_back) / layers.base_s;
}

// The same collectives inside a step: every rank runs the model's forward +
// backward and then a model-sized all-reduce and all-gather (ZeRO-1's
// gradients and parameters), or gathers each layer's ZeRO-3 span before the
// layer runs (twice: forward and recomputation), against the same without them.
void measure_collectives_in_step(const Session& session, const ModelConfig& config, Topology& topo, int g,
                                 Tp1Step& tp1, int concurrent_calls, Calibration& cal) {
  // The layout whose dp groups these are: the model at tp = N / g over the
  // complementary groups (strided ranks), or at tp 1 when that tp does not fit.
  const int model_tp = session.env.world_size / g;
  std::unique_ptr<CausalLM> at_tp;
  RankShape shape = tp1.shape;
  if (model_tp > 1 && model_tp <= config.num_heads) {
    const TpPlan plan = build_plan(config, model_tp);
    at_tp = std::make_unique<CausalLM>(config, plan, topo.dp(), session.options.dtype, session.options.device);
    at_tp->init_random(1);
    shape = rank_shape(config, plan, topo.dp().rank());
  }
  CausalLM& lm = at_tp ? *at_tp : tp1.lm;
  auto step = [&] {
    torch::AutoGradMode on(true);
    lm.token_losses(tp1.ids, tp1.ids).sum().backward();
  };
  const FlatLayout flat = FlatLayout::build({shape.local_numel}, {}, g, 3);  // the ZeRO-3 cut over the group
  const GroupStep gs{topo.tp(), g, lm, shape, flat, step, std::max(2, concurrent_calls / 2)};
  const Extra dp = measure_step_collective_extra(session, gs, cal);
  if (!at_tp) tp1.concurrent_samples.push_back(dp.base_s);
  measure_layer_gather_extra(session, config, gs, cal);
}

// The model's forward + backward at tp g, every tp group at once: what a layer
// costs at this tp beyond the GEMM, elementwise and lock-step collective costs
// (the tp autograd functions, waiting for the partner at each collective). Timed
// against the tp-1 step run by every rank at once, in alternating rounds: returns
// the median of its time over the tp-1 step's (the tp-1 rounds join its samples).
double measure_tp_step_ratio(const Session& session, const ModelConfig& config, Topology& topo, int g, Tp1Step& tp1,
                             int concurrent_calls) {
  const CalibrationOptions& options = session.options;
  const TpPlan plan = build_plan(config, g);
  CausalLM lm(config, plan, topo.tp(), options.dtype, options.device);
  lm.init_random(1);
  auto gen = at::detail::createCPUGenerator(1);
  auto ids = torch::randint(config.vocab_size, {options.micro_batch, options.seq_len}, gen, torch::kLong);
  torch::AutoGradMode on(true);
  constexpr int kRounds = 5;
  const auto r = session.concurrent_ratio([&] { tp1.run(); }, [&] { lm.token_losses(ids, ids).sum().backward(); },
                                          concurrent_calls, kRounds);
  tp1.concurrent_samples.push_back(r.base_s);
  return r.ratio;
}

// Collectives over Comm for every group size, world / size groups at once.
// Returns the model's forward + backward at each tp g that fits (by g), over the
// tp-1 step's at the same concurrency.
std::map<int, double> measure_group_sizes(const Session& session, const ModelConfig& config, Tp1Step& tp1,
                                          int concurrent_calls, Calibration& cal) {
  const DistEnv& env = session.env;
  std::map<int, double> tp_step_ratio;
  for (int g = 2; g <= env.world_size; ++g) {
    if (env.world_size % g != 0) continue;
    TopologyOptions topo_options;
    topo_options.tp_size = g;
    topo_options.backend = session.options.device.is_cuda() ? Backend::kNccl : Backend::kGloo;
    auto topo = Topology::create_with_store(prefix_store("calibration_g" + std::to_string(g), session.store),
                                            env.rank, env.world_size, topo_options);
    measure_collectives(session, *topo, g, cal);
    measure_collective_wake(session, *topo, g, cal);
    measure_collectives_in_step(session, config, *topo, g, tp1, concurrent_calls, cal);
    if (g <= config.num_heads)
      tp_step_ratio[g] = measure_tp_step_ratio(session, config, *topo, g, tp1, concurrent_calls);
  }
  session.barrier();
  return tp_step_ratio;
}

// `cal` without the framework overhead: what the micro-benchmarks alone predict.
Calibration without_overhead(const Calibration& cal) {
  Calibration without = cal;
  without.overhead_ratio = 0;
  without.overhead_ratio_by_tp.clear();
  return without;
}

// The framework overhead: rank 0's step alone over what the GEMM and elementwise
// costs predict, minus 1.
double fit_overhead_ratio(const Session& session, const ModelConfig& config, const RankShape& shape1,
                          const Calibration& cal, double alone_step_s) {
  const Calibration without = without_overhead(cal);
  SimLayout layout;
  layout.gpus = 1;  // rank 0 alone: no slowdown
  layout.micro_batch = session.options.micro_batch;
  layout.seq_len = session.options.seq_len;
  layout.dtype = session.options.dtype;
  auto t = estimate_time(config, shape1, layout, cpu_local_cluster(without, "calibration"));
  return std::max(0.0, (alone_step_s - t.dispatch_s) / (t.gemm_s + t.elementwise_s) - 1);
}

// What the step costs at tp g beyond the GEMM, elementwise and lock-step collective
// costs (the tp autograd functions, waiting for the partner at each collective),
// over the concurrency slowdown, as a share of the GEMM and elementwise costs.
void fit_overhead_ratio_by_tp(const Session& session, const ModelConfig& config,
                              const std::map<int, double>& tp_step_s, Calibration& cal) {
  for (const auto& [g, seconds] : tp_step_s) {
    auto cluster = cpu_local_cluster(without_overhead(cal), "calibration");
    SimLayout layout;
    layout.gpus = session.env.world_size;
    layout.tp = g;
    layout.micro_batch = session.options.micro_batch;
    layout.seq_len = session.options.seq_len;
    layout.dtype = session.options.dtype;
    // The slowest tp rank, as the simulator takes it (its tp_comm_s also holds the
    // per-step hash check and shared-slice reductions, a few small all-reduces).
    const TpPlan plan = build_plan(config, g);
    double predicted = 0, compute = 0;
    for (int r = 0; r < g; ++r) {
      auto t = estimate_time(config, rank_shape(config, plan, r), layout, cluster);
      if (t.gemm_s + t.elementwise_s + t.dispatch_s + t.tp_comm_s > predicted) {
        predicted = t.gemm_s + t.elementwise_s + t.dispatch_s + t.tp_comm_s;
        compute = t.gemm_s + t.elementwise_s;
      }
    }
    cal.overhead_ratio_by_tp[g] = std::max(0.0, (seconds - predicted) / compute);
  }
}

}  // namespace

Calibration run_calibration(const CalibrationOptions& options) {
  const DistEnv env = DistEnv::from_environment();
  Calibration cal = describe_machine(env, options);
  g_device = options.device;
  torch::NoGradGuard no_grad_default;
  const Session session(env, options);
  const HostCpuTimes cpu_at_start = host_cpu_times();
  const auto model = resolve_sim_model(options.model);
  const ModelConfig& config = model.config;
  // The tp-1 step alone is sampled before, amid and after the rest (the median is
  // kept): this machine's speed drifts by 10-25% over minutes, and the framework
  // overhead is the step over what the micro-benchmarks predict.
  Tp1Step tp1(config, options);
  // Rank 0 samples the dispatch right before each tp-1 sample, while the other
  // ranks already wait in that sample's broadcast.
  DispatchSamples dispatch(session, config);
  dispatch.sample();
  tp1.sample_alone(session);
  measure_gemms(session, config, options.dtype, cal.compute);
  measure_elementwise(session, options.dtype, cal.compute);
  // The other compute dtype by the same micro-benchmarks: one calibration times layouts in either.
  const torch::ScalarType other = options.dtype == torch::kFloat32 ? torch::kBFloat16 : torch::kFloat32;
  measure_gemms(session, config, other, cal.other_dtypes[dtype_label(other)]);
  measure_elementwise(session, other, cal.other_dtypes[dtype_label(other)]);
  measure_optimizer_step(session, config, cal);
  measure_cpu_adam(session, cal);

  dispatch.sample();
  tp1.sample_alone(session);
  // Calls per round when every rank runs that step (about window / 3).
  const int concurrent_calls =
      static_cast<int>(std::clamp(tp1.window / 3 / tp1.alone_samples[0], 3.0, 1000.0));
  if (session.world)
    tp1.concurrent_samples.push_back(session.concurrent_seconds([&] { tp1.run(); }, concurrent_calls));
  std::map<int, double> tp_step_ratio;  // the forward + backward at tp g over tp 1's, every rank at once
  if (session.world) tp_step_ratio = measure_group_sizes(session, config, tp1, concurrent_calls, cal);
  dispatch.sample();
  tp1.sample_alone(session);
  dispatch.store(session, cal);

  const double alone_step_s = median(tp1.alone_samples);
  if (session.world) cal.concurrency_slowdown = std::max(1.0, mean(tp1.concurrent_samples) / alone_step_s);
  std::map<int, double> tp_step_s;  // at the concurrency the slowdown describes
  for (const auto& [g, ratio] : tp_step_ratio) tp_step_s[g] = ratio * mean(tp1.concurrent_samples);
  cal.overhead_ratio = fit_overhead_ratio(session, config, tp1.shape, cal, alone_step_s);
  fit_overhead_ratio_by_tp(session, config, tp_step_s, cal);
  cal.host_steal_fraction = steal_fraction(cpu_at_start, host_cpu_times());
  return cal;
}

}  // namespace autotp::sim
