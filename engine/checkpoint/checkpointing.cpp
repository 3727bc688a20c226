#include "autotp/checkpoint/checkpointing.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cstring>
#include <filesystem>

#include "autotp/io/checksum.h"
#include "autotp/checkpoint/adapter_files.h"
#include "autotp/io/hf_writer.h"
#include "autotp/lora/lora_plan.h"
#include "autotp/model/presets.h"
#include "autotp/base/error.h"
#include "autotp/base/log.h"
#include "autotp/base/memory_counter.h"
#include "autotp/base/run_phase.h"
#include "autotp/tp/parallel_layers.h"

namespace autotp {
namespace {

// Where a checkpoint keeps the input model's companion files.
constexpr const char* kModelFilesDir = "model_files";

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kMessageBytes = 1024;  // room for one file problem in the verification exchange

std::vector<std::string> optimizer_state_names(const PartitionState& state) {
  std::vector<std::string> names;
  for (const auto& [name, t] : state.optimizer) names.push_back(name);
  return names;
}

torch::Tensor rng_state() { return at::detail::getDefaultCPUGenerator().get_state(); }

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_tensor_list(const std::vector<io::CheckpointTensor>& tensors) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> list;
  for (const auto& t : tensors) list.emplace_back(t.name, t.spec.global_shape());
  return list;
}

// Every tensor of the HF model in model order, other expert-parallel ranks' experts included.
std::vector<io::CheckpointTensor> model_tensors(CausalLM& model) {
  std::vector<io::CheckpointTensor> tensors;
  for (const auto& e : model.plan().entries())
    if (!e.adapter) tensors.push_back({e.desc.name, e.spec});
  return tensors;
}

std::vector<std::string> model_order(const nlohmann::json& model_config) {
  std::vector<std::string> names;
  for (const auto& d : describe_parameters(ModelConfig::from_json(model_config, "checkpoint model_config")))
    names.push_back(d.name);
  return names;
}

// Expert parallelism: the sub-directory of ep rank `ep_rank`'s experts.
std::string expert_part_name(int ep_rank) { return fmt::format("experts_ep{}", ep_rank); }

// What checkpoints hold: the parameters that train (all of them, or LoRA's adapters and modules_to_save).
std::vector<io::CheckpointTensor> trained_tensors(const ZeroOptimizer& zero) {
  std::vector<io::CheckpointTensor> tensors;
  for (const Parameter* p : zero.params()) tensors.push_back({p->name(), p->spec()});
  return tensors;
}

bool has_frozen(CausalLM& model) {
  for (auto& p : model.parameters())
    if (!p.trains()) return true;
  return false;
}

// The metadata of the trainer's state (files filled in by the caller).
io::CheckpointMetadata trainer_metadata(Trainer& trainer) {
  io::CheckpointMetadata m;
  auto& topo = trainer.topology();
  auto& zero = trainer.optimizer();
  TrainerState state = trainer.state();
  PartitionState partition = zero.partition_state();
  m.step = state.steps_done;
  m.tp = topo.tp_size();
  m.dp = topo.dp_size();
  m.stage = zero.stage();
  m.dtype = hf_dtype_name(zero.dtype());
  m.tensors = trained_tensors(zero);
  for (size_t i = 0; i < m.tensors.size(); ++i) m.tensors[i].unit = zero.unit_ids()[i];
  m.optimizer_states = optimizer_state_names(partition);
  m.model_config = trainer.model().config().raw;
  m.train_config = trainer.config().to_json();
  for (int e = 0; e < topo.ep_size() && topo.ep_size() > 1; ++e) m.expert_parts.push_back(expert_part_name(e));
  m.trainer = {{"steps", state.steps_done},
               {"applied_steps", state.applied_steps},
               {"optimizer", trainer.config().optimizer.type},
               {"optimizer_steps", partition.optimizer_steps},
               {"scheduler", {{"type", trainer.config().scheduler.type}, {"last_step", state.applied_steps}}}};
  if (trainer.sampler())
    m.sampler = {{"epoch", state.sampler.epoch},
                 {"offset", state.sampler.offset},
                 {"dataset_size", trainer.dataset()->size()},
                 {"seed", trainer.config().seed},
                 {"shuffle", trainer.shuffle()}};
  LossScalerState scaler = zero.loss_scaler_state();
  m.loss_scaler = {{"loss_scale", scaler.loss_scale},
                   {"good_steps", scaler.good_steps},
                   {"hysteresis_left", scaler.hysteresis_left}};
  return m;
}

// Every rank checks files rank, rank + world, ...; all learn the first problem.
void verify_collectively(const io::SavedCheckpoint& ckpt, Comm& world) {
  std::string mine;
  for (size_t i = world.rank(); i < ckpt.file_count() && mine.empty(); i += world.size())
    mine = ckpt.check_file(i);
  auto message = torch::zeros({1, kMessageBytes}, torch::kUInt8);
  std::memcpy(message.data_ptr(), mine.data(), std::min<size_t>(mine.size(), kMessageBytes - 1));
  auto all = world.all_gather(message, 0);
  for (int r = 0; r < world.size(); ++r) {
    std::string problem(reinterpret_cast<const char*>(all[r].data_ptr()));
    if (!problem.empty()) throw UserError(problem);
  }
}

void check_model_matches(const io::SavedCheckpoint& ckpt, Trainer& trainer) {
  const std::string where = (fs::path(ckpt.dir()) / io::kCheckpointMetadataFile).string();
  const auto saved = ckpt.all_tensors({});
  std::map<std::string, std::vector<int64_t>> shapes(saved.begin(), saved.end());
  int64_t trained = 0;  // every trained tensor of the model, other ep ranks' experts included
  for (const auto& e : trainer.model().plan().entries()) {
    if (e.frozen) continue;
    ++trained;
    auto found = shapes.find(e.desc.name);
    AUTOTP_USER_CHECK(found != shapes.end(),
                      "{}: the checkpoint has no tensor '{}' (was it saved from another model or LoRA config?)", where,
                      e.desc.name);
    AUTOTP_USER_CHECK(found->second == e.spec.global_shape(),
                      "{}: tensor '{}' has shape [{}] in the checkpoint but [{}] in the model", where, e.desc.name,
                      fmt::join(found->second, ", "), fmt::join(e.spec.global_shape(), ", "));
  }
  AUTOTP_USER_CHECK(static_cast<int64_t>(saved.size()) == trained,
                    "{}: the checkpoint has {} tensors, the model trains {} (was it saved from another model or "
                    "LoRA config?)",
                    where, saved.size(), trained);
}

// The specs of what `zero` holds, by name, for assembling its partition.
std::vector<std::pair<std::string, const ShardSpec*>> held_specs(const ZeroOptimizer& zero) {
  std::vector<std::pair<std::string, const ShardSpec*>> specs;
  for (const Parameter* p : zero.params()) specs.emplace_back(p->name(), &p->spec());
  return specs;
}

// fp32 master values and optimizer states for a partition of a target layout.
struct AssembledPartition {
  torch::Tensor master;
  std::map<std::string, torch::Tensor> optimizer;
};
AssembledPartition assemble_partition(const io::SavedCheckpoint& ckpt,
                                      const std::vector<std::pair<std::string, const ShardSpec*>>& specs,
                                      int tp_rank, const FlatLayout& layout, int dp_rank,
                                      const std::vector<std::string>& optimizer_states) {
  // The partition is the rank's slice of every unit, one stretch of the flat buffer each.
  auto assemble = [&](const std::string& state) {
    auto out = torch::zeros({layout.part}, torch::kFloat32);
    for (const auto& piece : layout.pieces(dp_rank))
      out.narrow(0, piece.part_begin, piece.length)
          .copy_(ckpt.assemble(state, specs, tp_rank, layout, piece.flat_begin, piece.flat_begin + piece.length));
    return out;
  };
  AssembledPartition part;
  part.master = assemble("master");
  for (const auto& name : optimizer_states) part.optimizer[name] = assemble("optimizer." + name);
  return part;
}

torch::ScalarType export_dtype(const ExportOptions& options, torch::ScalarType training) {
  torch::ScalarType dtype = options.dtype.value_or(training);
  AUTOTP_USER_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
                    "export dtype {} is not allowed (allowed: f32, bf16, f16)", c10::toString(dtype));
  return dtype;
}

// A checkpoint never holds a NaN or an infinity: every rank checks its partition
// (weights, fp32 masters, optimizer states) and all refuse together, before
// anything is written. Collective over the world.
void refuse_non_finite(const PartitionState& partition, Topology& topo, int64_t step) {
  std::string first;
  const auto check = [&](const std::string& name, const torch::Tensor& t) {
    if (first.empty() && t.defined() && t.is_floating_point() && !torch::isfinite(t).all().item<bool>()) first = name;
  };
  check("weights", partition.params);
  check("fp32 master weights", partition.master_weights);
  for (const auto& [name, t] : partition.optimizer) check("optimizer state " + name, t);
  const int world = topo.world_size();
  auto bad_rank = torch::tensor({static_cast<int64_t>(first.empty() ? world : topo.rank())}, torch::kLong);
  topo.world().all_reduce(bad_rank, ReduceOp::kMin);
  const int64_t rank = bad_rank.item<int64_t>();
  if (rank == world) return;
  throw NonFiniteError(fmt::format("checkpoint of step {} not written: rank {} holds non-finite {}", step, rank,
                                   rank == topo.rank() ? first : "values"));
}

// The test hook's names of the save's points (AUTOTP_TEST_FAULT's "at=", docs/testing.md).
const char* save_point_name(SavePhase phase) {
  switch (phase) {
    case SavePhase::kRankFilePartlyWritten: return "rank_file_partly_written";
    case SavePhase::kRankFileWritten: return "rank_file_written";
    case SavePhase::kMetadataWritten: return "metadata_written";
    case SavePhase::kRenamed: return "renamed";
  }
  return "";
}

// Expert parallelism: every rank writes its partition of its ep rank's experts
// into staging/experts_ep<E>/ (at stage 0 only edp rank 0: the others hold
// copies); each part's first rank writes the part's metadata. Collective over the world.
void save_expert_part(ZeroOptimizer& experts, Topology& topo, const io::CheckpointMetadata& top,
                      const std::string& staging) {
  PartitionState partition = experts.partition_state();
  refuse_non_finite(partition, topo, top.step);
  const fs::path dir = fs::path(staging) / expert_part_name(topo.ep_rank());
  std::error_code error;
  fs::create_directories(dir, error);  // every rank of the part: whoever comes first creates it
  AUTOTP_USER_CHECK(fs::is_directory(dir), "{}: cannot create directory: {}", dir.string(), error.message());
  const bool holds_states = experts.stage() > 0 || topo.edp_rank() == 0;
  torch::Tensor none;
  const auto tensors = io::rank_file_tensors(
      holds_states ? partition.params : none, holds_states ? partition.master_weights : none,
      holds_states ? partition.optimizer : std::vector<std::pair<std::string, torch::Tensor>>{}, rng_state());
  const std::string path = (dir / io::rank_file_name(topo.tp_rank(), topo.edp_rank())).string();
  io::write_safetensors(path, tensors);
  const auto sum = io::checksum_file(path);
  auto record = torch::tensor({static_cast<int64_t>(sum.crc32), static_cast<int64_t>(sum.bytes)}, torch::kLong);
  auto records = topo.world().all_gather(record.view({1, 2}), 0);
  if (topo.edp_rank() != 0 || topo.tp_rank() != 0) return;
  io::CheckpointMetadata part = top;
  part.dp = topo.edp_size();
  part.expert_parts.clear();
  part.dtype = hf_dtype_name(experts.dtype());
  part.tensors.clear();
  for (size_t i = 0; i < experts.params().size(); ++i)
    part.tensors.push_back({experts.params()[i]->name(), experts.params()[i]->spec(), experts.unit_ids()[i]});
  part.files.clear();
  for (int d = 0; d < topo.edp_size(); ++d)
    for (int t = 0; t < topo.tp_size(); ++t) {
      const int rank = (d * topo.ep_size() + topo.ep_rank()) * topo.tp_size() + t;
      part.files.push_back({io::rank_file_name(t, d), t, d, static_cast<uint32_t>(records[rank][0].item<int64_t>()),
                            static_cast<uint64_t>(records[rank][1].item<int64_t>())});
    }
  io::write_text_file_atomic((dir / io::kCheckpointMetadataFile).string(), part.to_json().dump(1) + "\n");
}

}  // namespace

std::string checkpoint_model_files(const io::SavedCheckpoint& checkpoint) {
  const fs::path files = fs::path(checkpoint.dir()) / kModelFilesDir;
  std::error_code error;
  return fs::is_directory(files, error) ? files.string() : std::string();
}

std::string save_checkpoint(Trainer& trainer, const std::string& root, const SaveOptions& options) {
  torch::NoGradGuard no_grad;
  auto& topo = trainer.topology();
  Comm& world = topo.world();
  io::CheckpointMetadata meta = trainer_metadata(trainer);
  publish_phase("checkpoint", meta.step);
  const auto hook = [&](SavePhase phase) {
    phase_point(save_point_name(phase));
    if (options.fault_hook) options.fault_hook(phase);
  };
  PartitionState partition = trainer.optimizer().partition_state();
  refuse_non_finite(partition, topo, meta.step);
  // Rank 0 prepares the staging directory before anyone writes into it.
  std::string staging = (fs::path(root) / fmt::format(".{}.partial", io::step_dir_name(meta.step))).string();
  if (topo.rank() == 0) staging = io::prepare_staging(root, meta.step);
  world.barrier();

  // Every rank writes its partition (at stage 0 only dp rank 0: the others hold copies).
  const bool holds_states = meta.stage > 0 || topo.dp_rank() == 0;
  torch::Tensor no_tensor;
  auto tensors = io::rank_file_tensors(holds_states ? partition.params : no_tensor,
                                       holds_states ? partition.master_weights : no_tensor,
                                       holds_states ? partition.optimizer
                                                    : std::vector<std::pair<std::string, torch::Tensor>>{},
                                       rng_state());
  std::vector<io::SafetensorsWriter::Entry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  const std::string file_name = io::rank_file_name(topo.tp_rank(), topo.dp_rank());
  io::SafetensorsWriter writer((fs::path(staging) / file_name).string(), entries);
  for (size_t i = 0; i < tensors.size(); ++i) {
    writer.write(tensors[i].second);
    if (i == 0 && tensors.size() > 1) hook(SavePhase::kRankFilePartlyWritten);
  }
  const uint32_t crc = writer.commit();
  hook(SavePhase::kRankFileWritten);
  auto record = torch::tensor({static_cast<int64_t>(crc), static_cast<int64_t>(writer.bytes_written())}, torch::kLong);
  auto records = world.all_gather(record.view({1, 2}), 0);
  for (int r = 0; r < topo.world_size(); ++r) {
    const auto c = Topology::coordinates(r, topo.tp_size());
    meta.files.push_back({io::rank_file_name(c.tp_rank, c.dp_rank), c.tp_rank, c.dp_rank,
                          static_cast<uint32_t>(records[r][0].item<int64_t>()),
                          static_cast<uint64_t>(records[r][1].item<int64_t>())});
  }

  if (ZeroOptimizer* experts = trainer.optimizer().experts()) save_expert_part(*experts, topo, meta, staging);

  if (topo.rank() == 0 && !options.model_files_dir.empty()) {
    const fs::path files = fs::path(staging) / kModelFilesDir;
    std::error_code error;
    fs::create_directories(files, error);
    AUTOTP_USER_CHECK(!error, "{}: cannot create directory: {}", files.string(), error.message());
    io::copy_companion_files(options.model_files_dir, files.string());
  }
  if (options.gather_16bit_weights) {
    ExportOptions export_options;
    export_options.model_files_dir = options.model_files_dir;
    const auto dtype = trainer.model().dtype();
    export_options.dtype = dtype == torch::kFloat32 ? torch::kBFloat16 : dtype;
    export_options.within_save = true;
    export_hf(trainer, (fs::path(staging) / "hf_model").string(), export_options);
  }
  if (!meta.expert_parts.empty()) world.barrier();  // every part's metadata is in the staging directory
  if (topo.rank() == 0)
    io::commit_checkpoint(
        root, staging, meta, [&] { hook(SavePhase::kMetadataWritten); }, [&] { hook(SavePhase::kRenamed); });
  world.barrier();  // nobody goes on (or reads `latest`) before the save is complete
  const std::string dir = (fs::path(root) / io::step_dir_name(meta.step)).string();
  log().info("saved checkpoint {} (tp {}, dp {}, ZeRO stage {})", dir, meta.tp, meta.dp, meta.stage);
  return dir;
}

int64_t load_checkpoint(Trainer& trainer, const std::string& path) {
  return load_checkpoint(trainer, io::SavedCheckpoint::open(path));
}

int64_t load_checkpoint(Trainer& trainer, const io::SavedCheckpoint& ckpt) {
  publish_phase("load", ckpt.metadata().step);
  torch::NoGradGuard no_grad;
  auto& topo = trainer.topology();
  const auto& meta = ckpt.metadata();
  const std::string where = (fs::path(ckpt.dir()) / io::kCheckpointMetadataFile).string();
  check_model_matches(ckpt, trainer);
  if (meta.train_config.contains("lora") && meta.train_config["lora"].is_object()) {
    // The adapters' tensors fit (checked above); their scale must be the one they were trained with.
    const LoraConfig saved = LoraConfig::from_adapter_config(meta.train_config["lora"], where + " (train_config.lora)");
    const LoraConfig& now = trainer.config().lora;
    AUTOTP_USER_CHECK(saved.scaling() == now.scaling(),
                      "{}: the checkpoint's adapters were trained with lora_alpha {} and use_rslora {} (scaling {}), "
                      "the config has lora_alpha {} and use_rslora {} (scaling {}); allowed: the checkpoint's values",
                      where, saved.lora_alpha, saved.use_rslora, saved.scaling(), now.lora_alpha, now.use_rslora,
                      now.scaling());
  }
  const auto wanted = optimizer_state_names(trainer.optimizer().partition_state());
  AUTOTP_USER_CHECK(wanted == meta.optimizer_states,
                    "{}: the checkpoint holds optimizer states [{}] (optimizer {}), the config's optimizer {} "
                    "needs [{}]",
                    where, fmt::join(meta.optimizer_states, ", "), meta.trainer.value("optimizer", "?"),
                    trainer.config().optimizer.type, fmt::join(wanted, ", "));
  verify_collectively(ckpt, topo.world());

  const int64_t optimizer_steps = meta.trainer.at("optimizer_steps").get<int64_t>();
  auto part = assemble_partition(ckpt, held_specs(trainer.optimizer()), topo.tp_rank(), trainer.optimizer().layout(),
                                 topo.dp_rank(), meta.optimizer_states);
  trainer.optimizer().load_partition_state(part.master, part.optimizer, optimizer_steps);
  if (ZeroOptimizer* experts = trainer.optimizer().experts()) {  // the ep rank's experts, partitioned over edp
    auto expert_part = assemble_partition(ckpt, held_specs(*experts), topo.tp_rank(), experts->layout(),
                                          topo.edp_rank(), meta.optimizer_states);
    experts->load_partition_state(expert_part.master, expert_part.optimizer, optimizer_steps);
  }
  trainer.optimizer().set_loss_scaler_state({meta.loss_scaler.at("loss_scale").get<double>(),
                                             meta.loss_scaler.at("good_steps").get<int64_t>(),
                                             meta.loss_scaler.at("hysteresis_left").get<int>()});
  TrainerState state;
  state.steps_done = meta.trainer.at("steps").get<int64_t>();
  state.applied_steps = meta.trainer.at("applied_steps").get<int64_t>();
  if (trainer.sampler()) {
    AUTOTP_USER_CHECK(!meta.sampler.is_null(), "{}: the checkpoint has no data position (saved without a dataset)",
                      where);
    state.sampler.epoch = meta.sampler.at("epoch").get<int64_t>();
    state.sampler.offset = meta.sampler.at("offset").get<int64_t>();
    const int64_t size = meta.sampler.at("dataset_size").get<int64_t>();
    if (size != trainer.dataset()->size() || meta.sampler.at("seed").get<uint64_t>() != trainer.config().seed ||
        meta.sampler.at("shuffle").get<bool>() != trainer.shuffle())
      log().warn("resuming with other data settings than the checkpoint's (examples {} vs {}, seed {} vs {}, "
                 "shuffle {} vs {}): the data order will differ from the uninterrupted run",
                 trainer.dataset()->size(), size, trainer.config().seed, meta.sampler.at("seed").get<uint64_t>(),
                 trainer.shuffle(), meta.sampler.at("shuffle").get<bool>());
  }
  trainer.restore(state);
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the default one
  generator.set_state(ckpt.read_rng_state(topo.rank()));
  log().info("resumed from {} at step {} (saved at tp {}, dp {}, ZeRO stage {}; now tp {}, dp {}, stage {})",
             ckpt.dir(), state.steps_done, meta.tp, meta.dp, meta.stage, topo.tp_size(), topo.dp_size(),
             trainer.optimizer().stage());
  return state.steps_done;
}

void export_hf(Trainer& trainer, const std::string& dir, const ExportOptions& options) {
  // A save's 16-bit weights are part of the checkpoint phase.
  if (!options.within_save) publish_phase("export", trainer.steps_done());
  torch::NoGradGuard no_grad;
  if (has_frozen(trainer.model())) return export_merged_hf(trainer, dir, options);
  auto& topo = trainer.topology();
  auto& model = trainer.model();
  const auto tensors = model_tensors(model);
  std::unique_ptr<io::HfModelWriter> writer;
  if (topo.rank() == 0) {
    writer = std::make_unique<io::HfModelWriter>(dir, model.config().raw, hf_tensor_list(tensors),
                                                 export_dtype(options, model.dtype()), options.max_shard_bytes);
    writer->copy_companions_from(options.model_files_dir);
  }
  ZeroOptimizer& zero = trainer.optimizer();
  const int tp_rank = topo.tp_rank();
  std::map<std::string, size_t> dense, experts;  // name -> index among what each optimizer holds
  for (size_t i = 0; i < zero.params().size(); ++i) dense[zero.params()[i]->name()] = i;
  if (zero.experts())
    for (size_t i = 0; i < zero.experts()->params().size(); ++i) experts[zero.experts()->params()[i]->name()] = i;
  const ExpertPlacement& placement = model.expert_placement();
  reset_memory_peak();
  const int64_t at_start = memory_counts().current;
  int64_t largest = 0;
  for (const auto& t : tensors) {
    torch::Tensor full;
    if (auto d = dense.find(t.name); d != dense.end()) {
      // This tp rank's shard gathered over dp, then (dp group 0 only) the whole tensor over tp.
      const FlatLayout& layout = zero.layout();
      auto local = zero.gather_master(layout.offsets[d->second], layout.offsets[d->second] + layout.numels[d->second])
                       .view(t.spec.local_shape(tp_rank));
      if (topo.dp_rank() != 0) continue;
      full = gather_full(t.spec, local, topo.tp());
    } else {
      // A routed expert under expert parallelism: its ep rank gathers it over edp and
      // tp, then the ep group of rank 0 broadcasts it from its owner.
      const int owner = placement.owner(model.plan().entry(t.name).expert);
      if (auto x = experts.find(t.name); x != experts.end()) {
        const FlatLayout& layout = zero.experts()->layout();
        auto local = zero.experts()
                         ->gather_master(layout.offsets[x->second], layout.offsets[x->second] + layout.numels[x->second])
                         .view(t.spec.local_shape(tp_rank));
        if (topo.edp_rank() == 0) full = gather_full(t.spec, local, topo.tp());
      }
      if (topo.edp_rank() != 0 || tp_rank != 0) continue;
      if (!full.defined()) full = torch::empty(t.spec.global_shape(), torch::TensorOptions().dtype(torch::kFloat32).device(model.device()));
      topo.ep().broadcast(full, owner);
      if (topo.rank() != 0) continue;
    }
    largest = std::max<int64_t>(largest, full.numel() * full.element_size());
    if (writer) writer->write(t.name, full);
  }
  if (writer) {
    writer->finish();
    // The extra memory of the export: about the largest tensor (gathered, plus its cast and pieces).
    log().info("exported {} ({} tensors, {:.2f} MB; rank 0 peak extra memory {:.2f} MB, largest tensor {:.2f} MB)",
               dir, tensors.size(), writer->total_bytes() / 1e6, (memory_counts().peak - at_start) / 1e6,
               largest / 1e6);
  }
  topo.world().barrier();
}

void export_hf(const io::SavedCheckpoint& ckpt, const std::string& dir, const ExportOptions& options) {
  torch::NoGradGuard no_grad;
  const auto& meta = ckpt.metadata();
  AUTOTP_USER_CHECK(!meta.train_config.contains("lora") || meta.train_config["lora"].is_null(),
                    "{}: a LoRA checkpoint holds the adapters only (not a whole model); export a merged model with "
                    "`autotp train ... --resume {} --export-hf DIR --merge-lora`, or the adapter with --save-adapter",
                    ckpt.dir(), ckpt.dir());
  const auto tensors = ckpt.all_tensors(model_order(meta.model_config));  // experts of every ep rank in model order
  io::HfModelWriter writer(dir, meta.model_config, tensors, export_dtype(options, parse_dtype(meta.dtype)),
                           options.max_shard_bytes);
  writer.copy_companions_from(options.model_files_dir.empty() ? checkpoint_model_files(ckpt) : options.model_files_dir);
  for (const auto& [name, shape] : tensors) writer.write(name, ckpt.read_full(name, "master"));
  writer.finish();
}

std::string reshard_checkpoint(const io::SavedCheckpoint& ckpt, int tp, int dp, int stage,
                               const std::string& out_root) {
  torch::NoGradGuard no_grad;
  const auto& old = ckpt.metadata();
  AUTOTP_USER_CHECK(dp >= 1, "--dp {} is not allowed (at least 1)", dp);
  AUTOTP_USER_CHECK(stage >= 0 && stage <= 3, "--stage {} is not allowed (allowed: 0, 1, 2, 3)", stage);
  AUTOTP_USER_CHECK(fs::weakly_canonical(out_root) != fs::weakly_canonical(ckpt.dir()) &&
                        fs::weakly_canonical(out_root) != fs::weakly_canonical(fs::path(ckpt.dir()).parent_path()),
                    "--out {} is the checkpoint being read; choose another directory", out_root);
  ckpt.verify();
  auto config = TrainConfig::from_json(old.train_config, (fs::path(ckpt.dir()) / io::kCheckpointMetadataFile).string());
  TpPlanOptions plan_options;
  plan_options.tp_size = tp;
  plan_options.layer_specs = config.tensor_parallel.layer_specs;
  TpPlan plan = TpPlan::build(ModelConfig::from_json(old.model_config, "checkpoint model_config"), plan_options);
  if (config.lora.enabled) plan = with_lora(std::move(plan), config.lora);  // the checkpoint holds what trains
  const std::vector<const PlanEntry*> entries = plan_entries(plan, /*frozen=*/false);
  const ZeroUnits zero_units{ModelConfig::from_json(old.model_config, "checkpoint model_config").num_layers};

  io::CheckpointMetadata meta = old;
  meta.tp = tp;
  meta.dp = dp;
  meta.stage = stage;
  meta.tensors.clear();
  std::vector<std::pair<std::string, const ShardSpec*>> specs;
  const int64_t threshold = meta.train_config.value("zero_optimization", nlohmann::json::object())
                                .value("stage3_param_persistence_threshold",
                                       ZeroConfig{}.stage3_param_persistence_threshold);
  const std::vector<int> units = zero_unit_ids(entries, zero_units, stage, threshold);
  for (const PlanEntry* e : entries) {
    meta.tensors.push_back({e->desc.name, e->spec, units[meta.tensors.size()]});
    specs.emplace_back(e->desc.name, &e->spec);
    AUTOTP_USER_CHECK(ckpt.holds(e->desc.name), "checkpoint {}: has no tensor '{}'", ckpt.dir(), e->desc.name);
  }
  meta.files.clear();
  meta.expert_parts.clear();  // the experts join the other tensors (ep 1)
  // The config travels along for reference; a resume uses the config it is given.
  meta.train_config["tensor_parallel"]["autotp_size"] = tp;
  meta.train_config.erase("expert_parallel");
  meta.train_config["zero_optimization"]["stage"] = stage;
  const int64_t tbs = meta.train_config.value("train_batch_size", int64_t{0});
  const int64_t gas = meta.train_config.value("gradient_accumulation_steps", int64_t{1});
  if (tbs > 0 && tbs % (gas * dp) == 0) meta.train_config["train_micro_batch_size_per_gpu"] = tbs / (gas * dp);

  const torch::ScalarType dtype = parse_dtype(old.dtype);
  const std::string staging = io::prepare_staging(out_root, meta.step);
  for (int t = 0; t < tp; ++t) {
    const FlatLayout layout = meta.layout(t);
    for (int d = 0; d < dp; ++d) {
      torch::Tensor params, master;
      std::vector<std::pair<std::string, torch::Tensor>> optimizer;
      if (stage > 0 || d == 0) {
        auto part = assemble_partition(ckpt, specs, t, layout, d, old.optimizer_states);
        params = part.master.to(dtype);
        if (meta.mixed_precision()) master = part.master;
        for (const auto& name : old.optimizer_states) optimizer.emplace_back(name, part.optimizer[name]);
      }
      const std::string name = io::rank_file_name(t, d);
      const std::string path = (fs::path(staging) / name).string();
      io::write_safetensors(path, io::rank_file_tensors(params, master, optimizer, ckpt.read_rng_state(d * tp + t)));
      const auto sum = io::checksum_file(path);
      meta.files.push_back({name, t, d, sum.crc32, sum.bytes});
    }
  }
  if (const std::string files = checkpoint_model_files(ckpt); !files.empty()) {
    const fs::path copy = fs::path(staging) / kModelFilesDir;
    fs::create_directories(copy);
    io::copy_companion_files(files, copy.string());
  }
  io::commit_checkpoint(out_root, staging, meta);
  return (fs::path(out_root) / io::step_dir_name(meta.step)).string();
}

}  // namespace autotp
