// Ulysses sequence parallelism: the sp ranks of a group each hold a chunk of every sequence
// (model/micro_batch.h); attention needs whole sequences, so q, k and v go through one all-to-all
// from sequence-sharded / all heads to whole-sequence / head-sharded, attention runs on the whole
// sequences for this rank's heads, and the output comes back with a second all-to-all. The
// backward reverses both (dout to heads; dq, dk, dv back to tokens).
//
// Heads: rank j gets query heads [j H/sp, (j+1) H/sp) and the kv heads those use. With G % sp == 0
// that is G/sp kv heads of its own; with sp % G == 0 (G < sp) each kv head is replicated to the
// sp/G ranks whose query heads use it, and in the backward their gradients are summed at the
// source. Other head counts are refused (check_sp_heads names them).
//
// Rows travel as contiguous blocks, packed and unpacked on the tensors' device by strided copies
// (device_mem::copy_2d: one cudaMemcpy2DAsync per block on CUDA, no host round trip) into wire
// buffers the exchange keeps and reuses. Every rank sends the same number of elements to every rank,
// so the all-to-alls need no count exchange and recompute re-issues exactly the same ones.
#pragma once
#include <initializer_list>
#include <memory>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace mt {

// Throws unless sp divides num_attention_heads and sp and num_key_value_heads divide one another,
// naming the numbers.
void check_sp_heads(int64_t num_attention_heads, int64_t num_key_value_heads, int sp);


class UlyssesExchange {
 public:
  // sp: the sequence-parallel group (its rank order is chunk order).
  UlyssesExchange(comm::Communicator& sp, int64_t heads, int64_t kv_heads, int64_t head_dim);
  int size() const { return sp_.size(); }
  int64_t local_heads() const { return Hl_; }
  int64_t local_kv_heads() const { return Gl_; }

  // Forward. q [B C, H, Hd], k and v [B C, G, Hd] (this rank's tokens) -> qf [B S', Hl, Hd],
  // kf and vf [B S', Gl, Hd] (whole sequences, this rank's heads). One all_to_all_v.
  void to_heads(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, Tensor& qf, Tensor& kf, Tensor& vf);
  // of [B S', Hl, Hd] -> o [B C, H, Hd]. One all_to_all_v. Also the backward's dq (without k, v).
  void to_tokens(const Tensor& of, int64_t B, Tensor& o);
  // Backward. d [B C, H, Hd] -> df [B S', Hl, Hd] (the query part of to_heads). One all_to_all_v.
  void to_heads_q(const Tensor& d, int64_t B, Tensor& df);
  // dqf [B S', Hl, Hd], dkf and dvf [B S', Gl, Hd] -> dq [B C, H, Hd], dk and dv [B C, G, Hd] (=);
  // the gradients of a replicated kv head are summed over its replicas. One all_to_all_v.
  void grads_to_tokens(const Tensor& dqf, const Tensor& dkf, const Tensor& dvf, int64_t B, Tensor& dq, Tensor& dk,
                       Tensor& dv);

 private:
  int64_t kv_lo(int j) const;  // the first kv head rank j's query heads use
  Tensor wire(Tensor& buf, int64_t numel, DType dt);  // the first numel elements of a reused buffer
  void exchange(const Tensor& send, Tensor& recv, int64_t per);  // per elements to and from every rank
  void check_device(std::initializer_list<const Tensor*> ts, const char* what) const;
  comm::Communicator& sp_;
  int64_t H_, G_, Hd_, Hl_, Gl_;
  Tensor send_, recv_;
};

}  // namespace mt
