#include "autotp/model/expert_dispatch.h"

#include "autotp/comm/autograd_collectives.h"

namespace autotp {

torch::Tensor dispatch_to_experts(const torch::Tensor& x, const torch::Tensor& selected, const torch::Tensor& weights,
                                  const ExpertPlacement& placement, Comm& ep, const LocalExpert& run) {
  const int64_t k = selected.size(1), per = placement.per_rank(), width = placement.max_per_rank();
  const int size = placement.ep_size;
  // The choices ordered by expert; a stable sort keeps tokens ascending within an expert.
  const torch::Tensor experts = selected.reshape({-1});
  const torch::Tensor order = std::get<1>(experts.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor tokens = order.div(k, "floor");
  const torch::Tensor counts = torch::bincount(experts.cpu(), {}, placement.num_experts).to(torch::kLong);

  // Row r: how many rows go to each of rank r's experts (padded to the widest range).
  torch::Tensor outgoing = torch::zeros({size, width}, torch::kLong);
  std::vector<int64_t> send_counts(size), recv_counts(size);
  for (int r = 0; r < size; ++r) {
    outgoing[r].narrow(0, 0, placement.count(r)).copy_(counts.narrow(0, placement.first(r), placement.count(r)));
    send_counts[r] = outgoing[r].sum().item<int64_t>();
  }
  const std::vector<int64_t> one(size, 1);
  const torch::Tensor incoming = ep.all_to_all(outgoing, one, one);  // [source, local expert]
  const auto receives = incoming.sum(1);
  for (int r = 0; r < size; ++r) recv_counts[r] = receives[r].item<int64_t>();
  const torch::Tensor received = all_to_all_rows(x.index_select(0, tokens), ep, send_counts, recv_counts);

  // Rows arrive source by source, each source's ordered by expert. Take them
  // expert by expert (`by_expert`), run each local expert on its contiguous run
  // of rows, and put the outputs back in arrival order.
  const auto in = incoming.accessor<int64_t, 2>();
  std::vector<int64_t> by_expert;
  by_expert.reserve(static_cast<size_t>(received.size(0)));
  std::vector<int64_t> next(size, 0), expert_rows(per, 0);  // next[s]: source s's first row not yet taken
  for (int s = 1; s < size; ++s) next[s] = next[s - 1] + recv_counts[s - 1];
  for (int64_t e = 0; e < per; ++e) {
    for (int s = 0; s < size; ++s) {
      for (int64_t i = 0; i < in[s][e]; ++i) by_expert.push_back(next[s]++);
      expert_rows[e] += in[s][e];
    }
  }
  const auto index_options = torch::TensorOptions().dtype(torch::kLong);
  const torch::Tensor gather = torch::tensor(by_expert, index_options).to(x.device());
  const torch::Tensor grouped = received.index_select(0, gather);
  std::vector<torch::Tensor> outputs;
  int64_t row = 0;
  for (int64_t e = 0; e < per; ++e) {
    outputs.push_back(run(e, grouped.narrow(0, row, expert_rows[e])));
    row += expert_rows[e];
  }
  const torch::Tensor computed = torch::cat(outputs);
  torch::Tensor arrival = torch::empty_like(gather);
  arrival.index_put_({gather}, torch::arange(gather.numel(), gather.options()));
  const torch::Tensor returned = all_to_all_rows(computed.index_select(0, arrival), ep, recv_counts, send_counts);

  const torch::Tensor w = weights.reshape({-1}).index_select(0, order).unsqueeze(-1);
  return torch::zeros_like(x).index_add(0, tokens, returned * w);
}

}  // namespace autotp
