// shard_micro_batch (micro_batch.h): host planning of a micro-batch's sequence chunk.
#include "model/micro_batch.h"

#include <algorithm>

#include "core/error.h"

namespace mt {

MicroBatch shard_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS, int sp, int sp_rank, int row_multiple) {
  if (sp == 1) return MicroBatch{ids_BS, labels_BS};
  if (ids_BS.dim() != 2 || ids_BS.dtype() != DType::I64) MT_THROW("input_ids must be i64 [B, S], got ", ids_BS.desc());
  const bool labels = labels_BS.defined();
  if (labels && (labels_BS.shape() != ids_BS.shape() || labels_BS.dtype() != DType::I64))
    MT_THROW("labels must be i64 with the shape of input_ids ", shape_str(ids_BS.shape()), ", got ", labels_BS.desc());
  MT_CHECK(sp_rank >= 0 && sp_rank < sp, "sp rank ", sp_rank, " of ", sp);
  auto sh = std::make_shared<SeqShard>();
  const int64_t B = ids_BS.size(0), S = ids_BS.size(1);
  sh->sp = sp;
  sh->rank = sp_rank;
  sh->seq_len = S;
  MT_CHECK(row_multiple >= 1, "row_multiple ", row_multiple);
  sh->padded_len = (S + sp - 1) / sp * sp;
  while (B * (sh->padded_len / sp) % row_multiple != 0) sh->padded_len += sp;  // tp splits the B × C rows
  const int64_t C = sh->chunk = sh->padded_len / sp, s0 = int64_t(sp_rank) * C;
  sh->valid = std::max<int64_t>(0, std::min(C, S - s0));
  Tensor ids = ids_BS.to(Device::CPU), lab = labels ? labels_BS.to(Device::CPU) : Tensor();
  Tensor local_ids = Tensor::empty({B, C}, DType::I64);
  sh->positions = Tensor::empty({B * C}, DType::I32);
  if (labels) sh->shifted_labels = Tensor::empty({B * C}, DType::I64);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t s = s0 + c, t = b * C + c;
      local_ids.data<int64_t>()[t] = s < S ? ids.data<int64_t>()[b * S + s] : 0;
      sh->positions.data<int32_t>()[t] = int32_t(s);
      // HF shift over the whole sequence: the target of position s is labels[s + 1], which for the
      // last token of a chunk lies in the next rank's chunk (every rank has the whole batch).
      if (labels)
        sh->shifted_labels.data<int64_t>()[t] = s + 1 < S ? lab.data<int64_t>()[b * S + s + 1] : int64_t(-100);
    }
  MicroBatch mb{local_ids.to(ids_BS.device()), Tensor()};
  mb.shard = std::move(sh);
  return mb;
}

}  // namespace mt
