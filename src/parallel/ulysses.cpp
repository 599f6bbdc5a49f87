#include "parallel/ulysses.h"

#include <cstring>

namespace mt {

void check_sp_heads(const ModelConfig& c, int sp) {
  const int64_t H = c.num_attention_heads, G = c.num_key_value_heads;
  if (sp < 1) MT_THROW("sp ", sp, " must be at least 1");
  if (H % sp != 0)
    MT_THROW("num_attention_heads (", H, ") must be divisible by sp (", sp,
             "): Ulysses sequence parallelism gives each sp rank H / sp query heads");
  if (G % sp != 0 && sp % G != 0)
    MT_THROW("num_key_value_heads (", G, ") and sp (", sp,
             ") must divide one another: each sp rank takes G / sp kv heads, or one kv head replicated "
             "over sp / G ranks");
}

MicroBatch shard_micro_batch(const Tensor& ids_BS, const Tensor& labels_BS, int sp, int sp_rank) {
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
  sh->padded_len = (S + sp - 1) / sp * sp;
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

UlyssesExchange::UlyssesExchange(comm::Communicator& sp, int64_t heads, int64_t kv_heads, int64_t head_dim)
    : sp_(sp), H_(heads), G_(kv_heads), Hd_(head_dim) {
  const int n = sp.size();
  MT_CHECK(H_ % n == 0 && (G_ % n == 0 || n % G_ == 0), "heads ", H_, ", kv heads ", G_, ", sp ", n);
  Hl_ = H_ / n;
  Gl_ = G_ >= n ? G_ / n : 1;
}

int64_t UlyssesExchange::kv_lo(int j) const {
  return int64_t(j) * Hl_ / (H_ / G_);
}

namespace {

// Host copies for packing (the tensor itself on the CPU).
Tensor on_host(const Tensor& t) {
  return t.is_cpu() ? t : t.to(Device::CPU);
}

// A host tensor to unpack into, copied to `out` by finish() when `out` lives on a device.
struct HostOut {
  Tensor& out;
  Tensor host;
  explicit HostOut(Tensor& o) : out(o), host(o.is_cpu() ? o : Tensor::empty(o.shape(), o.dtype())) {}
  char* ptr() const { return static_cast<char*>(host.raw()); }
  void finish() {
    if (!out.is_cpu()) out.copy_from(host);
  }
};

// dst[i] += src[i] for n elements of dtype dt (the kv-head replicas' gradients).
void add_elems(char* dst, const char* src, int64_t n, DType dt) {
  if (dt == DType::F32) {
    float* d = reinterpret_cast<float*>(dst);
    const float* s = reinterpret_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
  } else if (dt == DType::BF16) {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
  } else {
    MT_THROW("Ulysses exchange: summing kv-head gradients in ", dtype_name(dt), " is not supported (f32, bf16)");
  }
}

// Token side: X [BC, N, Hd]; the block of heads [lo, lo + n) is [BC, n, Hd]. `row` = Hd elements in bytes.
void pack_tokens(const char* X, int64_t BC, int64_t N, int64_t lo, int64_t n, size_t row, char* dst) {
  for (int64_t t = 0; t < BC; ++t)
    std::memcpy(dst + size_t(t * n) * row, X + size_t(t * N + lo) * row, size_t(n) * row);
}
void unpack_tokens(const char* src, int64_t BC, int64_t N, int64_t lo, int64_t n, size_t row, char* X, bool add,
                   DType dt) {
  const int64_t per_row = int64_t(row / dtype_size(dt));
  for (int64_t t = 0; t < BC; ++t) {
    char* d = X + size_t(t * N + lo) * row;
    const char* s = src + size_t(t * n) * row;
    if (add)
      add_elems(d, s, n * per_row, dt);
    else
      std::memcpy(d, s, size_t(n) * row);
  }
}
// Head side: Y [B, sp C, n, Hd]; chunk i's block is [B, C, n, Hd] (one contiguous run per sequence).
void pack_heads(const char* Y, int64_t B, int64_t C, int sp, int i, int64_t n, size_t row, char* dst) {
  const size_t run = size_t(C * n) * row;
  for (int64_t b = 0; b < B; ++b) std::memcpy(dst + size_t(b) * run, Y + size_t((b * sp + i) * C * n) * row, run);
}
void unpack_heads(const char* src, int64_t B, int64_t C, int sp, int i, int64_t n, size_t row, char* Y) {
  const size_t run = size_t(C * n) * row;
  for (int64_t b = 0; b < B; ++b) std::memcpy(Y + size_t((b * sp + i) * C * n) * row, src + size_t(b) * run, run);
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  MT_CHECK(a.dtype() == b.dtype(), "Ulysses ", what, ": ", a.desc(), " vs ", b.desc());
}

}  // namespace

void UlyssesExchange::to_heads(const Tensor& q, const Tensor& k, const Tensor& v, int64_t B, Tensor& qf, Tensor& kf,
                               Tensor& vf) {
  const int n = sp_.size();
  const int64_t BC = q.size(0), C = BC / B;
  MT_CHECK(
      q.shape() == Shape({BC, H_, Hd_}) && k.shape() == Shape({BC, G_, Hd_}) && v.shape() == k.shape() && BC % B == 0,
      "Ulysses to_heads: q ", q.desc(), ", k ", k.desc(), ", v ", v.desc(), ", B ", B);
  MT_CHECK(qf.shape() == Shape({B * C * n, Hl_, Hd_}) && kf.shape() == Shape({B * C * n, Gl_, Hd_}) &&
               vf.shape() == kf.shape(),
           "Ulysses to_heads: qf ", qf.desc(), ", kf ", kf.desc(), ", vf ", vf.desc());
  check_same_dtype(q, k, "to_heads");
  check_same_dtype(q, v, "to_heads");
  const DType dt = q.dtype();
  const size_t row = size_t(Hd_) * dtype_size(dt);
  const int64_t qn = BC * Hl_ * Hd_, kn = BC * Gl_ * Hd_, per = qn + 2 * kn;
  Tensor hq = on_host(q), hk = on_host(k), hv = on_host(v);
  Tensor send = Tensor::empty({per * n}, dt);
  char* s = static_cast<char*>(send.raw());
  const size_t esz = dtype_size(dt);
  for (int j = 0; j < n; ++j) {
    char* blk = s + size_t(j * per) * esz;
    pack_tokens(static_cast<const char*>(hq.raw()), BC, H_, j * Hl_, Hl_, row, blk);
    pack_tokens(static_cast<const char*>(hk.raw()), BC, G_, kv_lo(j), Gl_, row, blk + size_t(qn) * esz);
    pack_tokens(static_cast<const char*>(hv.raw()), BC, G_, kv_lo(j), Gl_, row, blk + size_t(qn + kn) * esz);
  }
  Tensor wire_in = send.to(sp_.device()), wire_out = Tensor::empty({per * n}, dt, sp_.device());
  const std::vector<int64_t> counts(size_t(n), per);
  sp_.all_to_all_v(wire_in, counts, wire_out, counts)->wait();
  Tensor recv = on_host(wire_out);
  const char* r = static_cast<const char*>(recv.raw());
  HostOut oq(qf), ok(kf), ov(vf);
  for (int i = 0; i < n; ++i) {
    const char* blk = r + size_t(i * per) * esz;
    unpack_heads(blk, B, C, n, i, Hl_, row, oq.ptr());
    unpack_heads(blk + size_t(qn) * esz, B, C, n, i, Gl_, row, ok.ptr());
    unpack_heads(blk + size_t(qn + kn) * esz, B, C, n, i, Gl_, row, ov.ptr());
  }
  oq.finish();
  ok.finish();
  ov.finish();
}

void UlyssesExchange::to_heads_q(const Tensor& d, int64_t B, Tensor& df) {
  const int n = sp_.size();
  const int64_t BC = d.size(0), C = BC / B;
  MT_CHECK(d.shape() == Shape({BC, H_, Hd_}) && df.shape() == Shape({B * C * n, Hl_, Hd_}) && BC % B == 0,
           "Ulysses to_heads_q: ", d.desc(), " -> ", df.desc(), ", B ", B);
  check_same_dtype(d, df, "to_heads_q");
  const DType dt = d.dtype();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t per = BC * Hl_ * Hd_;
  Tensor hd = on_host(d), send = Tensor::empty({per * n}, dt);
  for (int j = 0; j < n; ++j)
    pack_tokens(static_cast<const char*>(hd.raw()), BC, H_, j * Hl_, Hl_, row,
                static_cast<char*>(send.raw()) + size_t(j * per) * esz);
  Tensor wire_in = send.to(sp_.device()), wire_out = Tensor::empty({per * n}, dt, sp_.device());
  const std::vector<int64_t> counts(size_t(n), per);
  sp_.all_to_all_v(wire_in, counts, wire_out, counts)->wait();
  Tensor recv = on_host(wire_out);
  HostOut o(df);
  for (int i = 0; i < n; ++i)
    unpack_heads(static_cast<const char*>(recv.raw()) + size_t(i * per) * esz, B, C, n, i, Hl_, row, o.ptr());
  o.finish();
}

void UlyssesExchange::to_tokens(const Tensor& of, int64_t B, Tensor& o) {
  const int n = sp_.size();
  const int64_t BC = o.size(0), C = BC / B;
  MT_CHECK(o.shape() == Shape({BC, H_, Hd_}) && of.shape() == Shape({B * C * n, Hl_, Hd_}) && BC % B == 0,
           "Ulysses to_tokens: ", of.desc(), " -> ", o.desc(), ", B ", B);
  check_same_dtype(o, of, "to_tokens");
  const DType dt = o.dtype();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t per = BC * Hl_ * Hd_;
  Tensor hof = on_host(of), send = Tensor::empty({per * n}, dt);
  for (int i = 0; i < n; ++i)
    pack_heads(static_cast<const char*>(hof.raw()), B, C, n, i, Hl_, row,
               static_cast<char*>(send.raw()) + size_t(i * per) * esz);
  Tensor wire_in = send.to(sp_.device()), wire_out = Tensor::empty({per * n}, dt, sp_.device());
  const std::vector<int64_t> counts(size_t(n), per);
  sp_.all_to_all_v(wire_in, counts, wire_out, counts)->wait();
  Tensor recv = on_host(wire_out);
  HostOut out(o);
  for (int j = 0; j < n; ++j)
    unpack_tokens(static_cast<const char*>(recv.raw()) + size_t(j * per) * esz, BC, H_, j * Hl_, Hl_, row, out.ptr(),
                  false, dt);
  out.finish();
}

void UlyssesExchange::grads_to_tokens(const Tensor& dqf, const Tensor& dkf, const Tensor& dvf, int64_t B, Tensor& dq,
                                      Tensor& dk, Tensor& dv) {
  const int n = sp_.size();
  const int64_t BC = dq.size(0), C = BC / B;
  MT_CHECK(dq.shape() == Shape({BC, H_, Hd_}) && dk.shape() == Shape({BC, G_, Hd_}) && dv.shape() == dk.shape() &&
               dqf.shape() == Shape({B * C * n, Hl_, Hd_}) && dkf.shape() == Shape({B * C * n, Gl_, Hd_}) &&
               dvf.shape() == dkf.shape() && BC % B == 0,
           "Ulysses grads_to_tokens: ", dqf.desc(), ", ", dkf.desc(), " -> ", dq.desc(), ", ", dk.desc());
  check_same_dtype(dq, dqf, "grads_to_tokens");
  check_same_dtype(dk, dkf, "grads_to_tokens");
  check_same_dtype(dq, dk, "grads_to_tokens");
  const DType dt = dq.dtype();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t qn = BC * Hl_ * Hd_, kn = BC * Gl_ * Hd_, per = qn + 2 * kn;
  Tensor hq = on_host(dqf), hk = on_host(dkf), hv = on_host(dvf), send = Tensor::empty({per * n}, dt);
  for (int i = 0; i < n; ++i) {
    char* blk = static_cast<char*>(send.raw()) + size_t(i * per) * esz;
    pack_heads(static_cast<const char*>(hq.raw()), B, C, n, i, Hl_, row, blk);
    pack_heads(static_cast<const char*>(hk.raw()), B, C, n, i, Gl_, row, blk + size_t(qn) * esz);
    pack_heads(static_cast<const char*>(hv.raw()), B, C, n, i, Gl_, row, blk + size_t(qn + kn) * esz);
  }
  Tensor wire_in = send.to(sp_.device()), wire_out = Tensor::empty({per * n}, dt, sp_.device());
  const std::vector<int64_t> counts(size_t(n), per);
  sp_.all_to_all_v(wire_in, counts, wire_out, counts)->wait();
  Tensor recv = on_host(wire_out);
  HostOut oq(dq), ok(dk), ov(dv);
  for (int j = 0; j < n; ++j) {
    const char* blk = static_cast<const char*>(recv.raw()) + size_t(j * per) * esz;
    // A replicated kv head (G < sp) comes back from each of its sp / G ranks, in rank order: the
    // first copy is written, the others added.
    const bool add = j > 0 && kv_lo(j) == kv_lo(j - 1);
    unpack_tokens(blk, BC, H_, j * Hl_, Hl_, row, oq.ptr(), false, dt);
    unpack_tokens(blk + size_t(qn) * esz, BC, G_, kv_lo(j), Gl_, row, ok.ptr(), add, dt);
    unpack_tokens(blk + size_t(qn + kn) * esz, BC, G_, kv_lo(j), Gl_, row, ov.ptr(), add, dt);
  }
  oq.finish();
  ok.finish();
  ov.finish();
}

}  // namespace mt
