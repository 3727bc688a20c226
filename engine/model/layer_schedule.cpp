#include "autotp/model/layer_schedule.h"

namespace autotp {

namespace {

// Runs fn with the model told which piece it is working on; the model leaves the
// piece however fn ends (an exception must not leave later forwards cut).
template <typename Fn>
auto in_piece(const LayerBlocks& b, PieceAxis axis, int64_t offset, Fn&& fn) {
  struct Leave {
    const LayerBlocks& b;
    ~Leave() { b.enter_piece(PieceAxis::kNone, -1); }
  } leave{b};
  b.enter_piece(axis, offset);
  return fn();
}

}  // namespace

torch::Tensor run_attention_block(const torch::Tensor& x, const LayerBlocks& b) {
  auto partial = b.attention(x);
  return b.after_attention(x, b.attention_split ? b.reduce(partial) : partial);
}

torch::Tensor run_layer_blocks(const torch::Tensor& x, const LayerBlocks& b, PieceAxis axis) {
  if (axis == PieceAxis::kNone) {
    auto out = run_attention_block(x, b);
    auto partial = b.mlp(out);
    return b.after_mlp(out, b.mlp_split ? b.reduce(partial) : partial);
  }
  TORCH_CHECK(b.attention_split && b.mlp_split, "run_layer_blocks: pieces need both blocks split over tp");
  const int64_t dim = axis == PieceAxis::kBatch ? 0 : 1;
  const int64_t length = x.size(dim);
  TORCH_CHECK(length >= 2, "run_layer_blocks: cannot cut ", length, " entries in two");
  const int64_t first = (length + 1) / 2;
  const int64_t offsets[2] = {0, first}, lengths[2] = {first, length - first};
  torch::Tensor pieces[2];
  for (int i = 0; i < 2; ++i) pieces[i] = x.narrow(dim, offsets[i], lengths[i]);

  StartedReduction attn[2];
  if (axis == PieceAxis::kBatch) {
    for (int i = 0; i < 2; ++i)
      attn[i] = b.start_reduce(in_piece(b, axis, offsets[i], [&] { return b.attention(pieces[i]); }));
  } else {  // causal attention over the whole sequence, its output reduced in two pieces
    auto partial = b.attention(x);
    for (int i = 0; i < 2; ++i) attn[i] = b.start_reduce(partial.narrow(dim, offsets[i], lengths[i]));
  }
  torch::Tensor out[2];
  StartedReduction mlp[2];
  for (int i = 0; i < 2; ++i) {
    attn[i].work.wait();
    in_piece(b, axis, offsets[i], [&] {
      out[i] = b.after_attention(pieces[i], attn[i].output);
      mlp[i] = b.start_reduce(b.mlp(out[i]));
      return 0;
    });
  }
  torch::Tensor y[2];
  for (int i = 0; i < 2; ++i) {
    mlp[i].work.wait();
    y[i] = in_piece(b, axis, offsets[i], [&] { return b.after_mlp(out[i], mlp[i].output); });
  }
  return torch::cat({y[0], y[1]}, dim);
}

}  // namespace autotp
