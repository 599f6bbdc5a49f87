// The process-wide deterministic switch (`--deterministic`, or MOETRAIN_DETERMINISTIC=1 for benches and
// tests). Off by default: the fast kernels stay as they are. On, every CUDA op on the training path gives
// the same bits from run to run on the same GPU model and layout: no float atomics (RMSNorm dw, the
// embedding gradient, the router's probability and z-loss sums take fixed-order partial sums), and
// cuDNN's SDPA backward runs its deterministic algorithm (or the reference kernels when cuDNN refuses).
// The CPU backend is deterministic either way. docs/cuda.md, "Deterministic mode", lists what changes.
#pragma once

namespace mt {

// Whether deterministic kernels are requested. Unless set_deterministic was called, this is the
// environment's MOETRAIN_DETERMINISTIC (unset, "" or "0": off; "1": on; anything else is an error that
// names the value), read once.
bool deterministic();
// Overrides the environment for the rest of the process (or until called again). Call it before the
// first op of a run: ops that cache a per-shape choice (cuDNN attention plans) key it by the switch.
void set_deterministic(bool on);

// Sets the switch for a scope and puts the previous state back at its end (tests).
class DeterministicScope {
 public:
  explicit DeterministicScope(bool on);
  ~DeterministicScope();
  DeterministicScope(const DeterministicScope&) = delete;
  DeterministicScope& operator=(const DeterministicScope&) = delete;

 private:
  bool prev_;
};

// The batch-invariant switch (MOETRAIN_BATCH_INVARIANT=1, or set_batch_invariant). CPU backend: every GEMM
// computes each output row from its own input row in one fixed order (no BLAS blocking, which depends on the
// number of rows), and the training attention computes each query row as the paged decode attention does (fp64
// dots, softmax and weighted sum, in key order). CUDA backend: the forward GEMMs run one cuBLASLt algorithm for every row
// count (backend/cuda/gemm.cu), the experts their usual tiles (which give the same bits), and both attentions and
// the log-prob reductions take the kernels of backend/cuda/invariant.cuh. A token's log-prob then depends on its
// sequence alone, not on the batch around it, and the rollout engine's log-probs equal the trainer's forward on
// the same tokens bit for bit. Slower: for on-policy RL without a rollout/trainer gap, and for tests. Set it
// before the first op (read once from the environment otherwise).
bool batch_invariant();
void set_batch_invariant(bool on);

class BatchInvariantScope {
 public:
  explicit BatchInvariantScope(bool on);
  ~BatchInvariantScope();
  BatchInvariantScope(const BatchInvariantScope&) = delete;
  BatchInvariantScope& operator=(const BatchInvariantScope&) = delete;

 private:
  bool prev_;
};

}  // namespace mt
