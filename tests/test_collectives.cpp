// Comm collectives and the autograd collectives over real Gloo ranks (world
// sizes 1..4). Every rank's input is distinct, so each expected value has a
// closed form and a misplaced chunk fails loudly.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include "autotp/comm/autograd_collectives.h"
#include "support/multiprocess.h"

namespace {

using autotp::Comm;
using autotp::ReduceOp;
using autotp::test::worker_expect_close;
using autotp::test::worker_expect_equal;

// Rank q's block: rows x cols with value 1000 q + 10 i + j.
torch::Tensor rank_block(int q, int64_t rows, int64_t cols, torch::Dtype dtype = torch::kFloat32) {
  auto i = torch::arange(rows, torch::kFloat64).unsqueeze(1);
  auto j = torch::arange(cols, torch::kFloat64).unsqueeze(0);
  return (1000.0 * q + 10.0 * i + j).to(dtype);
}

// Rank-distinct tensor (q + 1) * [0, 1, 2, ...] of the given shape.
torch::Tensor scaled_arange(int q, std::vector<int64_t> shape) {
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
  return torch::arange(n, torch::kFloat32).reshape(shape) * static_cast<float>(q + 1);
}

int64_t sum_of_ranks_plus_one(int world) { return static_cast<int64_t>(world) * (world + 1) / 2; }

Comm& world_comm(autotp::test::WorkerContext& ctx) { return ctx.topology(1)->world(); }

}  // namespace

AUTOTP_WORKER(all_reduce) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  const torch::Tensor base = torch::arange(12, torch::kFloat32).reshape({3, 4});
  const double total = static_cast<double>(sum_of_ranks_plus_one(w));

  torch::Tensor sum = base * (r + 1);
  comm.all_reduce(sum);
  worker_expect_equal(sum, base * total, "all_reduce sum");

  // base >= 0, so over (q + 1) * base the max is w * base and the min is base.
  torch::Tensor max = base * (r + 1);
  comm.all_reduce(max, ReduceOp::kMax);
  worker_expect_equal(max, base * w, "all_reduce max");
  torch::Tensor min = base * (r + 1);
  comm.all_reduce(min, ReduceOp::kMin);
  worker_expect_equal(min, base, "all_reduce min");

  // A non-contiguous view is reduced in place through a contiguous buffer.
  torch::Tensor storage = base * (r + 1);
  torch::Tensor transposed = storage.t();
  comm.all_reduce(transposed);
  worker_expect_equal(storage, base * total, "all_reduce of a transposed view");

  torch::Tensor integers = torch::arange(5, torch::kInt64) * (r + 1);
  comm.all_reduce(integers);
  worker_expect_equal(integers, torch::arange(5, torch::kInt64) * static_cast<int64_t>(total),
                      "all_reduce int64");

  torch::Tensor bf16 = (base * (r + 1)).to(torch::kBFloat16);
  comm.all_reduce(bf16);
  WORKER_CHECK(bf16.scalar_type() == torch::kBFloat16, "dtype changed to ", bf16.scalar_type());
  worker_expect_equal(bf16, (base * total).to(torch::kBFloat16), "all_reduce bfloat16");

  const int64_t expected_calls = w > 1 ? 6 : 0;
  WORKER_CHECK(comm.stats().all_reduce_calls == expected_calls, "all_reduce_calls ",
               comm.stats().all_reduce_calls, " expected ", expected_calls);
  const int64_t expected_bytes = w > 1 ? 4 * 12 * 4 + 5 * 8 + 12 * 2 : 0;
  WORKER_CHECK(comm.stats().all_reduce_bytes == expected_bytes, "all_reduce_bytes ",
               comm.stats().all_reduce_bytes, " expected ", expected_bytes);
}

AUTOTP_WORKER(broadcast) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  for (int root = 0; root < w; ++root) {
    torch::Tensor x = rank_block(r, 3, 5);
    comm.broadcast(x, root);
    worker_expect_equal(x, rank_block(root, 3, 5), "broadcast from root " + std::to_string(root));
    torch::Tensor bf16 = rank_block(r, 2, 3, torch::kBFloat16);
    comm.broadcast(bf16, root);
    worker_expect_equal(bf16, rank_block(root, 2, 3, torch::kBFloat16), "broadcast bfloat16");
    torch::Tensor mask = torch::arange(6) % (r + 2) == 0;
    comm.broadcast(mask, root);
    worker_expect_equal(mask, torch::arange(6) % (root + 2) == 0, "broadcast bool");
  }
  WORKER_CHECK(comm.stats().broadcast_calls == (w > 1 ? 3 * w : 0), "broadcast_calls ",
               comm.stats().broadcast_calls);
}

AUTOTP_WORKER(all_gather) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  std::vector<torch::Tensor> expected;

  // Even, along dim 0.
  for (int q = 0; q < w; ++q) expected.push_back(rank_block(q, 2, 3));
  worker_expect_equal(comm.all_gather(rank_block(r, 2, 3), 0), torch::cat(expected, 0),
                      "all_gather even dim 0");

  // Even, along the last dim (given as -1).
  expected.clear();
  for (int q = 0; q < w; ++q) expected.push_back(rank_block(q, 3, 2));
  worker_expect_equal(comm.all_gather(rank_block(r, 3, 2), -1), torch::cat(expected, 1),
                      "all_gather even dim -1");

  // Uneven along dim 0, including ranks that hold nothing: sizes q % 3.
  std::vector<int64_t> sizes;
  expected.clear();
  for (int q = 0; q < w; ++q) {
    sizes.push_back(q % 3);
    expected.push_back(rank_block(q, q % 3, 3));
  }
  worker_expect_equal(comm.all_gather(rank_block(r, r % 3, 3), 0, sizes), torch::cat(expected, 0),
                      "all_gather uneven dim 0");

  // Uneven along dim 1: sizes q + 1.
  sizes.clear();
  expected.clear();
  for (int q = 0; q < w; ++q) {
    sizes.push_back(q + 1);
    expected.push_back(rank_block(q, 2, q + 1));
  }
  worker_expect_equal(comm.all_gather(rank_block(r, 2, r + 1), 1, sizes), torch::cat(expected, 1),
                      "all_gather uneven dim 1");

  expected.clear();
  for (int q = 0; q < w; ++q) expected.push_back(rank_block(q, 2, 2, torch::kBFloat16));
  worker_expect_equal(comm.all_gather(rank_block(r, 2, 2, torch::kBFloat16), 0), torch::cat(expected, 0),
                      "all_gather bfloat16");

  if (w > 1) {
    // Bytes of the gathered outputs: 6w + 6w + 3(sum of q % 3) + 2(sum of q + 1) floats + 4w bf16.
    int64_t uneven_rows = 0;
    for (int q = 0; q < w; ++q) uneven_rows += q % 3;
    const int64_t expected_bytes = 4 * (12 * w + 3 * uneven_rows + 2 * sum_of_ranks_plus_one(w)) + 2 * 4 * w;
    WORKER_CHECK(comm.stats().all_gather_calls == 5, "all_gather_calls ", comm.stats().all_gather_calls);
    WORKER_CHECK(comm.stats().all_gather_bytes == expected_bytes, "all_gather_bytes ",
                 comm.stats().all_gather_bytes, " expected ", expected_bytes);
  }
}

AUTOTP_WORKER(reduce_scatter) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  // Rank q's full tensor: (q + 1) * idx + q; the sum over ranks is S * idx + w(w-1)/2.
  auto full_of = [&](int q, int64_t rows) { return scaled_arange(q, {rows, 3}) + static_cast<float>(q); };
  auto summed = [&](int64_t rows) {
    return scaled_arange(0, {rows, 3}) * static_cast<float>(sum_of_ranks_plus_one(w)) +
           static_cast<float>(w * (w - 1) / 2);
  };

  // Even: 2 rows each.
  const torch::Tensor full = full_of(r, 2 * w);
  const torch::Tensor before = full.clone();
  worker_expect_equal(comm.reduce_scatter(full), summed(2 * w).narrow(0, 2 * r, 2), "reduce_scatter even");
  worker_expect_equal(full, before, "reduce_scatter leaves its input alone");

  // Uneven: rank q keeps q + 1 rows.
  std::vector<int64_t> sizes;
  for (int q = 0; q < w; ++q) sizes.push_back(q + 1);
  const int64_t rows = sum_of_ranks_plus_one(w);
  const int64_t offset = static_cast<int64_t>(r) * (r + 1) / 2;
  worker_expect_equal(comm.reduce_scatter(full_of(r, rows), sizes), summed(rows).narrow(0, offset, r + 1),
                      "reduce_scatter uneven");

  // Uneven with empty chunks: rank q keeps q % 2 rows.
  sizes.clear();
  int64_t odd_rows = 0, odd_offset = 0;
  for (int q = 0; q < w; ++q) {
    sizes.push_back(q % 2);
    if (q < r) odd_offset += q % 2;
    odd_rows += q % 2;
  }
  worker_expect_equal(comm.reduce_scatter(full_of(r, odd_rows), sizes),
                      summed(odd_rows).narrow(0, odd_offset, r % 2), "reduce_scatter with empty chunks");

  if (w > 1) {
    WORKER_CHECK(comm.stats().reduce_scatter_calls == 3, "reduce_scatter_calls ",
                 comm.stats().reduce_scatter_calls);
    WORKER_CHECK(comm.stats().all_reduce_calls == 0, "reduce_scatter counted as all_reduce");
  }
}

// Started collectives: several in flight on the lane, a synchronous one issued
// behind them (it must wait for them: the group's order), closed-form results,
// the in-place gather of this rank's own block, and the counters.
AUTOTP_WORKER(started_collectives) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  const int64_t n = 5;  // elements of each rank's chunk / block
  auto summed = [&](int64_t rows, int64_t cols) {
    return scaled_arange(0, {rows, cols}) * static_cast<float>(sum_of_ranks_plus_one(w));
  };
  // Reduce-scatter of a contiguous fp32 tensor, of a column view (copied when it runs), and of bf16.
  auto full = scaled_arange(r, {w * n});
  auto wide = scaled_arange(r, {w, 2 * n});
  auto half = scaled_arange(r, {w * n}).to(torch::kBFloat16);
  auto chunk = torch::empty({n}), column_chunk = torch::empty({n}), half_chunk = torch::empty({n}, torch::kBFloat16);
  auto a = comm.start_reduce_scatter_into(chunk, full);
  auto b = comm.start_reduce_scatter_into(column_chunk, wide.narrow(1, n, n));
  auto c = comm.start_reduce_scatter_into(half_chunk, half);
  // Gathers: into a separate output, and in place from this rank's own block.
  auto gathered = torch::empty({w * n});
  auto d = comm.start_all_gather_into(gathered, rank_block(r, 1, n).view({-1}));
  auto in_place = torch::zeros({w, n});
  in_place[r].copy_(rank_block(r, 1, n).view({-1}));
  auto e = comm.start_all_gather_into(in_place.view({-1}), in_place[r]);
  // Synchronous, behind the started ones.
  auto total = torch::full({3}, static_cast<float>(r + 1));
  comm.all_reduce(total);
  worker_expect_equal(total, torch::full({3}, static_cast<float>(sum_of_ranks_plus_one(w))), "all_reduce behind");
  for (auto* work : {&a, &b, &c, &d, &e}) work->wait();
  a.wait();  // a second wait does nothing
  worker_expect_equal(chunk, summed(w, n)[r], "started reduce_scatter");
  worker_expect_equal(column_chunk, summed(w, 2 * n)[r].narrow(0, n, n), "started reduce_scatter of a column view");
  worker_expect_equal(half_chunk, summed(w, n)[r].to(torch::kBFloat16), "started reduce_scatter bfloat16");
  std::vector<torch::Tensor> blocks;
  for (int q = 0; q < w; ++q) blocks.push_back(rank_block(q, 1, n));
  worker_expect_equal(gathered, torch::cat(blocks, 0).view({-1}), "started all_gather");
  worker_expect_equal(in_place, torch::cat(blocks, 0), "started all_gather in place");
  if (w > 1) {
    const auto stats = comm.stats();
    WORKER_CHECK(stats.reduce_scatter_calls == 3 && stats.all_gather_calls == 2 && stats.all_reduce_calls == 1,
                 "calls: reduce_scatter ", stats.reduce_scatter_calls, ", all_gather ", stats.all_gather_calls,
                 ", all_reduce ", stats.all_reduce_calls);
    WORKER_CHECK(stats.reduce_scatter_bytes == 4 * (2 * w * n) + 2 * w * n, "reduce_scatter bytes ",
                 stats.reduce_scatter_bytes);
    WORKER_CHECK(stats.all_gather_bytes == 2 * 4 * w * n, "all_gather bytes ", stats.all_gather_bytes);
    WORKER_CHECK(stats.async_seconds > 0, "started collectives not timed on the lane");
    // Any other overlap of input and output is refused, naming the rule.
    std::string message;
    try {
      auto out = torch::zeros({w * n});
      comm.start_all_gather_into(out, out.narrow(0, ((r + 1) % w) * n, n));
    } catch (const std::exception& error) {
      message = error.what();
    }
    WORKER_CHECK(message.find("own block") != std::string::npos, "overlapping gather not refused: ", message);
  } else {
    WORKER_CHECK(comm.stats().calls() == 0, "a size-1 group counted collectives");
  }
}

// A started collective whose peer is gone: wait() fails naming the op and the
// group; the one queued behind it is not run and fails at once with that error.
AUTOTP_WORKER(started_peer_exits) {
  ctx.barrier_at_exit = false;
  auto topology = ctx.topology(1);
  topology->world().barrier();
  if (ctx.env.rank == 1) std::_Exit(0);
  auto full = torch::ones({1024}), out = torch::empty({512}), second = torch::empty({512});
  auto work = topology->world().start_reduce_scatter_into(out, full);
  auto queued = topology->world().start_reduce_scatter_into(second, full);
  auto message_of = [](autotp::CommWork& w) {
    try {
      w.wait();
    } catch (const std::exception& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  const std::string message = message_of(work);
  WORKER_CHECK(message.find("Comm::reduce_scatter") != std::string::npos, "message lacks the op: ", message);
  WORKER_CHECK(message.find("group 'world'") != std::string::npos, "message lacks the group: ", message);
  const auto start = std::chrono::steady_clock::now();
  const std::string after = message_of(queued);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_CHECK(after.find("not run: an earlier collective of this group failed") != std::string::npos,
               "queued collective: ", after);
  WORKER_CHECK(seconds < 1, "the queued collective took ", seconds, " s to fail");
}

// copy_to_tp: identity forward, all-reduce backward; reduce_from_tp: the reverse.
AUTOTP_WORKER(autograd_copy_and_reduce) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  const double total = static_cast<double>(sum_of_ranks_plus_one(w));
  // Upstream gradient of rank q: (q + 1) * idx + 1; summed over ranks: S * idx + w.
  auto upstream = [&](int q) { return scaled_arange(q, {2, 3}) + 1.0f; };
  const torch::Tensor idx = scaled_arange(0, {2, 3});

  torch::Tensor x = scaled_arange(r, {2, 3}).requires_grad_(true);
  torch::Tensor y = autotp::copy_to_tp(x, comm);
  worker_expect_equal(y, scaled_arange(r, {2, 3}), "copy_to_tp forward");
  y.backward(upstream(r));
  worker_expect_equal(x.grad(), idx * total + static_cast<float>(w), "copy_to_tp backward");

  torch::Tensor x2 = scaled_arange(r, {2, 3}).requires_grad_(true);
  torch::Tensor y2 = autotp::reduce_from_tp(x2, comm);
  worker_expect_equal(y2, idx * total, "reduce_from_tp forward");
  worker_expect_equal(x2, scaled_arange(r, {2, 3}), "reduce_from_tp leaves its input alone");
  y2.backward(upstream(r));
  worker_expect_equal(x2.grad(), upstream(r), "reduce_from_tp backward");

  // The pair composed inside a computation: d/dx sum(w_r * reduce(copy(x) * 2)) = 2 * sum_q w_q.
  torch::Tensor x3 = torch::ones({4}, torch::kFloat32).requires_grad_(true);
  torch::Tensor out = autotp::reduce_from_tp(autotp::copy_to_tp(x3, comm) * 2.0f, comm);
  worker_expect_equal(out, torch::full({4}, 2.0 * w), "copy then reduce forward");
  (out * static_cast<float>(r + 1)).sum().backward();
  worker_expect_equal(x3.grad(), torch::full({4}, 2.0 * total), "copy then reduce backward");
}

// gather_from_tp: all-gather forward, own slice backward; scatter_to_tp: the reverse.
AUTOTP_WORKER(autograd_gather_and_scatter) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  for (bool uneven : {false, true}) {
    const std::string label = uneven ? " (uneven)" : " (even)";
    std::vector<int64_t> sizes;
    for (int q = 0; q < w; ++q) sizes.push_back(uneven ? q % 3 + 1 : 2);
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + r, int64_t{0});
    const std::vector<int64_t> passed = uneven ? sizes : std::vector<int64_t>{};

    // gather along dim 1 of [2, size_q] blocks.
    std::vector<torch::Tensor> blocks;
    for (int q = 0; q < w; ++q) blocks.push_back(rank_block(q, 2, sizes[q]));
    torch::Tensor x = rank_block(r, 2, sizes[r]).requires_grad_(true);
    torch::Tensor y = autotp::gather_from_tp(x, comm, 1, passed);
    worker_expect_equal(y, torch::cat(blocks, 1), "gather_from_tp forward" + label);
    const torch::Tensor upstream = rank_block(r + 7, 2, total);  // rank-dependent upstream gradient
    y.backward(upstream);
    worker_expect_equal(x.grad(), upstream.narrow(1, offset, sizes[r]), "gather_from_tp backward" + label);

    // scatter along the last dim (-1) of a rank-distinct full tensor.
    torch::Tensor full = rank_block(r + 20, 3, total).requires_grad_(true);
    torch::Tensor shard = autotp::scatter_to_tp(full, comm, -1, passed);
    worker_expect_equal(shard, rank_block(r + 20, 3, total).narrow(1, offset, sizes[r]),
                        "scatter_to_tp forward" + label);
    std::vector<torch::Tensor> grads;
    for (int q = 0; q < w; ++q) grads.push_back(rank_block(q + 40, 3, sizes[q]));
    shard.backward(rank_block(r + 40, 3, sizes[r]));
    worker_expect_equal(full.grad(), torch::cat(grads, 1), "scatter_to_tp backward" + label);
  }
}

// The sequence-parallel pair along dim 1 of [2, T, 3] with the remainder rule
// (T = 8, 7 and 3: even, uneven, and fewer tokens than ranks at world 4):
// gather_from_sp's backward sums every rank's gradient of this rank's slice;
// reduce_scatter_to_sp's forward is that sum, its backward an all-gather.
AUTOTP_WORKER(autograd_sequence_parallel) {
  Comm& comm = world_comm(ctx);
  const int r = comm.rank(), w = comm.size();
  auto block = [](int q, int64_t length) {  // [2, length, 3], distinct per q
    return rank_block(q, 2 * length, 3).reshape({2, length, 3});
  };
  for (int64_t length : {8, 7, 3}) {
    const std::string label = " (T " + std::to_string(length) + ")";
    const std::vector<int64_t> sizes = autotp::sequence_shard_sizes(length, w);
    WORKER_CHECK(std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == length, "sizes do not add up");
    WORKER_CHECK(sizes.front() - sizes.back() <= 1 && std::is_sorted(sizes.rbegin(), sizes.rend()),
                 "the first ranks take the remainder");
    const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + r, int64_t{0});
    auto sum_over_ranks = [&](int base) {
      torch::Tensor total = torch::zeros({2, length, 3});
      for (int q = 0; q < w; ++q) total += block(base + q, length);
      return total;
    };

    std::vector<torch::Tensor> slices;
    for (int q = 0; q < w; ++q)
      slices.push_back(block(q, length).narrow(1, std::accumulate(sizes.begin(), sizes.begin() + q, int64_t{0}), sizes[q]));
    torch::Tensor x = slices[r].clone().requires_grad_(true);
    torch::Tensor y = autotp::gather_from_sp(x, comm, 1, sizes);
    worker_expect_equal(y, torch::cat(slices, 1), "gather_from_sp forward" + label);
    y.backward(block(10 + r, length));
    worker_expect_equal(x.grad(), sum_over_ranks(10).narrow(1, offset, sizes[r]), "gather_from_sp backward" + label);

    torch::Tensor full = block(20 + r, length).requires_grad_(true);
    torch::Tensor shard = autotp::reduce_scatter_to_sp(full, comm, 1, sizes);
    worker_expect_equal(shard, sum_over_ranks(20).narrow(1, offset, sizes[r]), "reduce_scatter_to_sp forward" + label);
    std::vector<torch::Tensor> grads;
    for (int q = 0; q < w; ++q) grads.push_back(block(30 + q, sizes[q]));
    shard.backward(grads[r]);
    worker_expect_equal(full.grad(), torch::cat(grads, 1), "reduce_scatter_to_sp backward" + label);
  }
}

// Rank 1 leaves without taking part; rank 0's all-reduce must fail quickly with
// an error naming the op and the group (not hang until the 60 s timeout).
AUTOTP_WORKER(peer_exits) {
  ctx.barrier_at_exit = false;
  auto topology = ctx.topology(1);
  topology->world().barrier();  // both ranks are fully connected before rank 1 goes
  if (ctx.env.rank == 1) std::_Exit(0);
  torch::Tensor x = torch::ones({1024});
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    topology->world().all_reduce(x);
  } catch (const std::exception& error) {
    message = error.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_CHECK(!message.empty(), "all_reduce with a dead peer did not fail");
  WORKER_CHECK(message.find("Comm::all_reduce") != std::string::npos, "message lacks the op: ", message);
  WORKER_CHECK(message.find("group 'world'") != std::string::npos, "message lacks the group: ", message);
  WORKER_CHECK(seconds < 30, "took ", seconds, " s to notice the dead peer");
}

// Rank 1 stays alive but never joins the collective: the group timeout fires.
AUTOTP_WORKER(collective_timeout) {
  ctx.barrier_at_exit = false;
  ctx.timeout = std::chrono::seconds(2);
  auto topology = ctx.topology(1);
  topology->world().barrier();
  if (ctx.env.rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::_Exit(0);
  }
  torch::Tensor x = torch::ones({16});
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    topology->world().all_reduce(x);
  } catch (const std::exception& error) {
    message = error.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  WORKER_CHECK(!message.empty(), "all_reduce without a partner did not time out");
  WORKER_CHECK(message.find("Comm::all_reduce") != std::string::npos, "message lacks the op: ", message);
  WORKER_CHECK(message.find("group 'world'") != std::string::npos, "message lacks the group: ", message);
  WORKER_CHECK(seconds >= 1.5 && seconds < 4.5, "timed out after ", seconds, " s, expected about 2 s");
  std::_Exit(0);
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

AUTOTP_WORKER_TEST_P(CollectivesTest, AllReduceSumMaxMin, all_reduce)
AUTOTP_WORKER_TEST_P(CollectivesTest, BroadcastFromEveryRoot, broadcast)
AUTOTP_WORKER_TEST_P(CollectivesTest, AllGatherEvenAndUneven, all_gather)
AUTOTP_WORKER_TEST_P(CollectivesTest, ReduceScatterEvenAndUneven, reduce_scatter)
AUTOTP_WORKER_TEST_P(CollectivesTest, StartedCollectivesKeepTheGroupOrder, started_collectives)
AUTOTP_WORKER_TEST_P(CollectivesTest, AutogradCopyToAndReduceFrom, autograd_copy_and_reduce)
AUTOTP_WORKER_TEST_P(CollectivesTest, AutogradGatherFromAndScatterTo, autograd_gather_and_scatter)
AUTOTP_WORKER_TEST_P(CollectivesTest, AutogradSequenceParallelPair, autograd_sequence_parallel)

INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

TEST(StartedCollectives, OverGlooWithoutSharedMemory) {
  auto result = autotp::test::run_workers("started_collectives", 3, {}, {{"AUTOTP_SHARED_MEMORY", "0"}});
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(CommFailure, StartedCollectiveWithDeadPeerFailsOnWait) {
  auto result = autotp::test::run_workers("started_peer_exits", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(CommFailure, DeadPeerFailsFastNamingOpAndGroup) {
  auto result = autotp::test::run_workers("peer_exits", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(CommFailure, TimeoutNamesOpAndGroup) {
  auto result = autotp::test::run_workers("collective_timeout", 2);
  ASSERT_EQ(result.exit_code, 0) << result.summary;
}

TEST(CommSingle, SizeOneGroupDoesNothing) {
  Comm comm;
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.rank(), 0);
  torch::Tensor x = torch::arange(4, torch::kFloat32);
  comm.all_reduce(x);
  EXPECT_TRUE(torch::equal(x, torch::arange(4, torch::kFloat32)));
  comm.broadcast(x, 0);
  EXPECT_TRUE(torch::equal(comm.all_gather(x), x));
  EXPECT_TRUE(torch::equal(comm.reduce_scatter(x), x));
  comm.barrier();
  EXPECT_EQ(comm.stats().all_reduce_calls, 0);
  EXPECT_THROW(comm.broadcast(x, 1), c10::Error);
  EXPECT_THROW(comm.all_gather(x, 0, {3}), c10::Error);  // sizes disagree with the local tensor
}

TEST(WorkerChecks, ExpectCloseNamesTheWorstElement) {
  const torch::Tensor expected = torch::zeros({2, 3});
  torch::Tensor actual = expected.clone();
  actual[1][2] = 0.5;
  actual[0][1] = 0.25;
  try {
    worker_expect_close(actual, expected, 0.0, 0.1, "probe");
    FAIL() << "no throw";
  } catch (const std::runtime_error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("probe: 2 of 6 elements outside"), std::string::npos) << message;
    EXPECT_NE(message.find("max abs diff 0.5 at [1, 2]"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(worker_expect_close(actual, expected, 0.0, 0.6, "probe"));
  EXPECT_THROW(worker_expect_close(actual, torch::zeros({3, 2}), 1.0, 1.0, "shape"), std::runtime_error);
  const torch::Tensor nan = torch::full({1}, std::numeric_limits<double>::quiet_NaN());
  EXPECT_NO_THROW(worker_expect_equal(nan, nan, "nan matches nan"));
  EXPECT_THROW(worker_expect_equal(nan, torch::zeros({1}), "nan vs 0"), std::runtime_error);
  try {
    WORKER_CHECK(1 + 1 == 3, "arithmetic says ", 2);
    FAIL() << "no throw";
  } catch (const std::runtime_error& error) {
    EXPECT_NE(std::string(error.what()).find("WORKER_CHECK(1 + 1 == 3) failed at"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find(": arithmetic says 2"), std::string::npos);
  }
}
