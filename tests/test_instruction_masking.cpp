// Instruction data end to end: prompt tokens are masked by the data pipeline and
// contribute nothing to the loss or the gradients the model computes.
#include <gtest/gtest.h>

#include "autotp/data/batch.h"
#include "autotp/data/dataset.h"
#include "autotp/io/safetensors.h"
#include "autotp/model/presets.h"
#include "support/model_fixtures.h"

namespace autotp {
namespace {

std::vector<torch::Tensor> gradients_of(CausalLM& model, const torch::Tensor& loss) {
  for (auto& p : model.parameters()) p.tensor.mutable_grad() = torch::Tensor();
  loss.backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : model.parameters()) grads.push_back(p.tensor.grad().clone());
  return grads;
}

TEST(InstructionMasking, PromptTokensContributeNothingToLossOrGradients) {
  std::string dir = test::make_temp_dir("sft");
  io::write_text_file_atomic(dir + "/sft.jsonl",
                             R"({"instruction": "Add the numbers", "input": "2 and 3", "output": "5"})" "\n"
                             R"({"instruction": "Name a colour", "output": "blue"})" "\n");
  DataOptions options;
  options.sft.prompt_template = "plain";
  options.seq_len = 40;
  options.vocab_size = 259;
  auto data = open_dataset(dir + "/sft.jsonl", options);
  ASSERT_EQ(data->size(), 2);
  Batch batch = collate(*data, {0, 1});
  auto learned = batch.labels != kIgnoreLabel;
  // Only the outputs and their EOS are learned: "5" + EOS and "blue" + EOS.
  EXPECT_EQ(learned.sum().item<int64_t>(), 2 + 5);

  Comm self;
  auto source = resolve_model("preset:llama-tiny");
  auto model = load_model(source, TpPlan::build(source.config, {}), self, torch::kFloat32, 3);
  auto losses = model->token_losses(batch.input_ids, batch.labels);
  EXPECT_EQ(losses.masked_select(~learned).abs().max().item<float>(), 0.0f);
  auto engine_grads = gradients_of(*model, losses.sum());

  // The same quantity from plain cross-entropy over the learned positions only.
  auto logits = model->forward(batch.input_ids);
  auto picked = logits.index({learned});
  auto targets = batch.labels.index({learned});
  auto manual_grads =
      gradients_of(*model, torch::nn::functional::cross_entropy(
                               picked, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)));
  auto relative_diff = [](const torch::Tensor& a, const torch::Tensor& b) {
    return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
  };
  for (size_t i = 0; i < engine_grads.size(); ++i)
    EXPECT_LT(relative_diff(engine_grads[i], manual_grads[i]), 1e-5) << model->parameters()[i].name();

  // Unmasking the prompt changes the gradients, so the comparison above can fail.
  auto unmasked = batch.input_ids.narrow(1, 1, 39);
  auto all_labels = torch::cat({unmasked, torch::full({2, 1}, 257, torch::kLong)}, 1);
  all_labels.masked_fill_(batch.input_ids == 257, kIgnoreLabel);  // padding stays out
  auto unmasked_grads = gradients_of(*model, model->token_losses(batch.input_ids, all_labels).sum());
  EXPECT_GT(relative_diff(unmasked_grads[0], engine_grads[0]), 1e-2);
}

}  // namespace
}  // namespace autotp
