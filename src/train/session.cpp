#include "train/session.h"

#include "model/micro_batch.h"

namespace mt {

TrainSession::TrainSession(const ModelConfig& global, const SessionOptions& opt)
    : config_(global),
      device_(opt.device),
      dist_(DistContext::create(opt.device, opt.dist)),
      table_(global),
      pm_(make_parallel_model(*dist_, global, table_, opt.device, opt.fsdp, opt.moe_capacity_factor)) {
  model_ = std::make_unique<Qwen3MoeModel>(pm_.model_config(global), opt.device, pm_.fsdp.get());
  model_->recompute = opt.recompute;
  model_->score_before_experts = opt.score_before_experts;
  pm_.attach(*model_, *dist_);
}

void TrainSession::init_weights(uint64_t seed) {
  pm_.init_weights(*model_, table_, seed);
  refresh_compute_weights();
}

LoadReport TrainSession::load(const std::string& dir) {
  LoadReport rep = load_hf_weights_ranges(dir, config_, table_, pm_.pieces(table_), master());
  refresh_compute_weights();
  return rep;
}

MicroBatch TrainSession::local_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS) {
  Tensor ids = ids_BS, labels = labels_BS;
  const int dp = dist_->dp_size();
  if (dp > 1) {
    auto [r0, n] = dp_rows(ids.size(0), dist_->dp_rank(), dp);
    ids = ids.rows(r0, n);
    labels = labels.rows(r0, n);
  }
  return shard_micro_batch(ids, labels, dist_->mesh().size(Axis::Sp), dist_->sp_rank(),
                           dist_->mesh().size(Axis::Tp));
}

}  // namespace mt
