#include "moe/ulysses.h"

#include <cstring>

#include "ops/ops.h"
#include "ops/profile.h"

namespace mt {

void check_sp_heads(int64_t num_attention_heads, int64_t num_key_value_heads, int sp) {
  const int64_t H = num_attention_heads, G = num_key_value_heads;
  if (sp < 1) MT_THROW("sp ", sp, " must be at least 1");
  if (H % sp != 0)
    MT_THROW("num_attention_heads (", H, ") must be divisible by sp (", sp,
             "): Ulysses sequence parallelism gives each sp rank H / sp query heads");
  if (G % sp != 0 && sp % G != 0)
    MT_THROW("num_key_value_heads (", G, ") and sp (", sp,
             ") must divide one another: each sp rank takes G / sp kv heads, or one kv head replicated "
             "over sp / G ranks");
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

// Token side: X [BC, N, Hd]; the block of heads [lo, lo + n) is [BC, n, Hd], one strided run per
// token. `row` = Hd elements in bytes.
void pack_tokens(const char* X, int64_t BC, int64_t N, int64_t lo, int64_t n, size_t row, char* dst, Device d) {
  device_mem::copy_2d(dst, size_t(n) * row, X + size_t(lo) * row, size_t(N) * row, size_t(n) * row, size_t(BC), d);
}
void unpack_tokens(const char* src, int64_t BC, int64_t N, int64_t lo, int64_t n, size_t row, char* X, Device d) {
  device_mem::copy_2d(X + size_t(lo) * row, size_t(N) * row, src, size_t(n) * row, size_t(n) * row, size_t(BC), d);
}
// Head side: Y [B, sp C, n, Hd]; chunk i's block is [B, C, n, Hd] (one contiguous run per sequence).
void pack_heads(const char* Y, int64_t B, int64_t C, int sp, int i, int64_t n, size_t row, char* dst, Device d) {
  const size_t run = size_t(C * n) * row;
  device_mem::copy_2d(dst, run, Y + size_t(i) * run, size_t(sp) * run, run, size_t(B), d);
}
void unpack_heads(const char* src, int64_t B, int64_t C, int sp, int i, int64_t n, size_t row, char* Y, Device d) {
  const size_t run = size_t(C * n) * row;
  device_mem::copy_2d(Y + size_t(i) * run, size_t(sp) * run, src, run, run, size_t(B), d);
}

const char* cptr(const Tensor& t) {
  return static_cast<const char*>(t.raw());
}
char* mptr(const Tensor& t) {
  return static_cast<char*>(t.raw());
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  MT_CHECK(a.dtype() == b.dtype(), "Ulysses ", what, ": ", a.desc(), " vs ", b.desc());
}

}  // namespace

// The wire buffers grow to the largest exchange and are reused: every exchange waits for its
// all-to-all on the compute stream before the next one packs, so reuse needs no extra sync.
Tensor UlyssesExchange::wire(Tensor& buf, int64_t numel, DType dt) {
  if (!buf.defined() || buf.dtype() != dt || buf.numel() < numel) buf = Tensor::empty({numel}, dt, sp_.device());
  return buf.rows(0, numel);
}

void UlyssesExchange::exchange(const Tensor& send, Tensor& recv, int64_t per) {
  const std::vector<int64_t> counts(size_t(sp_.size()), per);
  ops::OpScope scope("comm_sp_all_to_all", send.device() == Device::CUDA);  // its time, when profiling
  sp_.all_to_all_v(send, counts, recv, counts)->wait();
}

void UlyssesExchange::check_device(std::initializer_list<const Tensor*> ts, const char* what) const {
  for (const Tensor* t : ts)
    MT_CHECK(t->device() == sp_.device(), "Ulysses ", what, ": ", t->desc(), " is not on the sp communicator's device");
}

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
  check_same_dtype(q, qf, "to_heads");
  check_device({&q, &k, &v, &qf, &kf, &vf}, "to_heads");
  const DType dt = q.dtype();
  const Device d = sp_.device();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t qn = BC * Hl_ * Hd_, kn = BC * Gl_ * Hd_, per = qn + 2 * kn;
  Tensor send = wire(send_, per * n, dt), recv = wire(recv_, per * n, dt);
  for (int j = 0; j < n; ++j) {
    char* blk = mptr(send) + size_t(j * per) * esz;
    pack_tokens(cptr(q), BC, H_, j * Hl_, Hl_, row, blk, d);
    pack_tokens(cptr(k), BC, G_, kv_lo(j), Gl_, row, blk + size_t(qn) * esz, d);
    pack_tokens(cptr(v), BC, G_, kv_lo(j), Gl_, row, blk + size_t(qn + kn) * esz, d);
  }
  exchange(send, recv, per);
  for (int i = 0; i < n; ++i) {
    const char* blk = cptr(recv) + size_t(i * per) * esz;
    unpack_heads(blk, B, C, n, i, Hl_, row, mptr(qf), d);
    unpack_heads(blk + size_t(qn) * esz, B, C, n, i, Gl_, row, mptr(kf), d);
    unpack_heads(blk + size_t(qn + kn) * esz, B, C, n, i, Gl_, row, mptr(vf), d);
  }
}

void UlyssesExchange::to_heads_q(const Tensor& dq, int64_t B, Tensor& df) {
  const int n = sp_.size();
  const int64_t BC = dq.size(0), C = BC / B;
  MT_CHECK(dq.shape() == Shape({BC, H_, Hd_}) && df.shape() == Shape({B * C * n, Hl_, Hd_}) && BC % B == 0,
           "Ulysses to_heads_q: ", dq.desc(), " -> ", df.desc(), ", B ", B);
  check_same_dtype(dq, df, "to_heads_q");
  check_device({&dq, &df}, "to_heads_q");
  const DType dt = dq.dtype();
  const Device d = sp_.device();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t per = BC * Hl_ * Hd_;
  Tensor send = wire(send_, per * n, dt), recv = wire(recv_, per * n, dt);
  for (int j = 0; j < n; ++j) pack_tokens(cptr(dq), BC, H_, j * Hl_, Hl_, row, mptr(send) + size_t(j * per) * esz, d);
  exchange(send, recv, per);
  for (int i = 0; i < n; ++i) unpack_heads(cptr(recv) + size_t(i * per) * esz, B, C, n, i, Hl_, row, mptr(df), d);
}

void UlyssesExchange::to_tokens(const Tensor& of, int64_t B, Tensor& o) {
  const int n = sp_.size();
  const int64_t BC = o.size(0), C = BC / B;
  MT_CHECK(o.shape() == Shape({BC, H_, Hd_}) && of.shape() == Shape({B * C * n, Hl_, Hd_}) && BC % B == 0,
           "Ulysses to_tokens: ", of.desc(), " -> ", o.desc(), ", B ", B);
  check_same_dtype(o, of, "to_tokens");
  check_device({&o, &of}, "to_tokens");
  const DType dt = o.dtype();
  const Device d = sp_.device();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t per = BC * Hl_ * Hd_;
  Tensor send = wire(send_, per * n, dt), recv = wire(recv_, per * n, dt);
  for (int i = 0; i < n; ++i) pack_heads(cptr(of), B, C, n, i, Hl_, row, mptr(send) + size_t(i * per) * esz, d);
  exchange(send, recv, per);
  for (int j = 0; j < n; ++j) unpack_tokens(cptr(recv) + size_t(j * per) * esz, BC, H_, j * Hl_, Hl_, row, mptr(o), d);
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
  check_device({&dqf, &dkf, &dvf, &dq, &dk, &dv}, "grads_to_tokens");
  const DType dt = dq.dtype();
  const Device d = sp_.device();
  const size_t row = size_t(Hd_) * dtype_size(dt), esz = dtype_size(dt);
  const int64_t qn = BC * Hl_ * Hd_, kn = BC * Gl_ * Hd_, per = qn + 2 * kn;
  Tensor send = wire(send_, per * n, dt), recv = wire(recv_, per * n, dt);
  for (int i = 0; i < n; ++i) {
    char* blk = mptr(send) + size_t(i * per) * esz;
    pack_heads(cptr(dqf), B, C, n, i, Hl_, row, blk, d);
    pack_heads(cptr(dkf), B, C, n, i, Gl_, row, blk + size_t(qn) * esz, d);
    pack_heads(cptr(dvf), B, C, n, i, Gl_, row, blk + size_t(qn + kn) * esz, d);
  }
  exchange(send, recv, per);
  // A replicated kv head (G < sp) comes back from each of its sp / G ranks, in rank order: the later
  // copies are added into the first one's block (k and v together: they are adjacent), which is then
  // the one unpacked.
  auto repeat = [this](int j) { return j > 0 && kv_lo(j) == kv_lo(j - 1); };  // a later copy of kv heads
  int first = 0;
  for (int j = 0; j < n; ++j) {
    if (repeat(j)) {
      Tensor acc = recv.rows(int64_t(first) * per + qn, 2 * kn);
      ops::add_(acc, recv.rows(int64_t(j) * per + qn, 2 * kn));
    } else {
      first = j;
    }
  }
  for (int j = 0; j < n; ++j) {
    const char* blk = cptr(recv) + size_t(j * per) * esz;
    unpack_tokens(blk, BC, H_, j * Hl_, Hl_, row, mptr(dq), d);
    if (repeat(j)) continue;  // summed into the first replica's block
    unpack_tokens(blk + size_t(qn) * esz, BC, G_, kv_lo(j), Gl_, row, mptr(dk), d);
    unpack_tokens(blk + size_t(qn + kn) * esz, BC, G_, kv_lo(j), Gl_, row, mptr(dv), d);
  }
}

}  // namespace mt
