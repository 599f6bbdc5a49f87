"""moetrain as a Python library: the engine's models, sampler and trainer in-process (docs/python.md).

    import moetrain as mt
    model = mt.Model("runs/demo/checkpoint-2500")           # a model directory or a preset ("tiny", ...)
    samples = model.sampler.sample([model.encode("12+34=")], n=4, max_new_tokens=8)
    out = model.trainer.forward_backward([mt.Datum(prompt, response, advantages=a, logprobs=lp)], loss="ppo")
    model.trainer.optim_step(mt.AdamParams(learning_rate=2e-4))

One Model is one set of weights: the sampler reads the weights the trainer updates, in place (no copy on one
device). Calls run in C++ with the GIL released; C++ errors arrive as moetrain.Error (a RuntimeError) with the
engine's message, bad arguments as ValueError / TypeError before any work, Ctrl-C as KeyboardInterrupt.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

# numpy is imported where it is used, so that importing the package (the stub generator at build time, where
# only the build's requirements are installed) needs only the module.
from ._moetrain import Error, __version__, _load_model, _presets
from . import rl, tasks  # noqa: F401

__all__ = ["Model", "Sampler", "Trainer", "Sample", "Datum", "AdamParams", "LoraConfig", "Error", "presets", "rl", "tasks"]


def presets() -> list:
    """The names a Model can start from without a directory (a random init at `seed`)."""
    return list(_presets())


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the frozen base (docs/lora.md): rank, alpha (0: 2 x rank), what is adapted."""

    rank: int = 16
    alpha: float = 0.0
    targets: str = "attn,mlp,experts"


@dataclasses.dataclass(frozen=True)
class AdamParams:
    """AdamW's parameters for optim_step. learning_rate may change from step to step; the others are fixed by
    the first step."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; <= 0: no clipping


@dataclasses.dataclass
class Sample:
    """One sampled response: its token ids, the sampler's log-prob of each, why it ended ("stop": a stop token
    or EOS, included in tokens; "length"), the text (when the model has a tokenizer) and, when asked, the
    routing record (int32 [layers, prompt + response - 1, experts_per_token])."""

    prompt_index: int
    sample_index: int
    tokens: Any  # numpy.ndarray
    logprobs: Any  # numpy.ndarray
    finish_reason: str
    text: Optional[str] = None
    routing: Any = None  # numpy.ndarray or None


def Datum(prompt, response, *, weights=None, advantages=None, logprobs=None, ref_logprobs=None, mask=None,
          routing=None) -> dict:
    """A training example for the trainer: prompt and response token ids, and per response token (each a sequence
    as long as the response): weights (cross-entropy: the loss is -sum w logp; default 1 / the batch's tokens),
    advantages and logprobs (the sampler's: the policy losses' old log-probs), ref_logprobs (kl_coef > 0),
    mask (1 the model's token, 0 an environment's observation: no loss on it), routing (the sample's routing
    record, Sample.routing: the forward then uses the experts the sampler chose; every datum of a call has one
    or none)."""
    d = {"prompt": prompt, "response": response}
    for k, v in (("weights", weights), ("advantages", advantages), ("logprobs", logprobs),
                 ("ref_logprobs", ref_logprobs), ("mask", mask), ("routing", routing)):
        if v is not None:
            d[k] = v
    return d


def _ids(model: "Model", p, what: str):
    import numpy as np

    if isinstance(p, str):
        return model.encode(p)
    if isinstance(p, np.ndarray):
        return p.astype(np.int32).tolist()
    try:
        return [int(t) for t in p]
    except TypeError:
        raise TypeError(f"{what}: expected text or a sequence of token ids, got {type(p).__name__}") from None


class Sampler:
    """Generation on the model's current weights (continuous batching, paged KV cache, CUDA graphs on a GPU)."""

    def __init__(self, model: "Model"):
        self._model = model

    def sample(self, prompts: Sequence[Union[str, Sequence[int]]], n: int = 1, max_new_tokens: int = 64,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0,
               stop: Sequence[Union[int, str]] = (), routing: bool = False) -> list:
        """n samples of each prompt (text or token ids): a list per prompt of Sample, in sample order. stop: token
        ids (or single-token strings) that end a response besides the EOS. The draws are a function of (seed,
        prompt index, sample index): the same call gives the same samples."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError("sample: prompts must be a list (of texts or of token-id lists), not one string")
        m = self._model
        ids = [_ids(m, p, f"sample: prompt {i}") for i, p in enumerate(prompts)]
        stop_ids = []
        for s in stop:
            if isinstance(s, str):
                t = m.encode(s)
                if len(t) != 1:
                    raise ValueError(f"sample: stop {s!r} is {len(t)} tokens; a stop must be one token")
                stop_ids.append(t[0])
            else:
                stop_ids.append(int(s))
        raw = m._m.sample(ids, int(n), int(max_new_tokens), float(temperature), float(top_p), int(top_k),
                          float(min_p), int(seed), stop_ids, bool(routing))
        out = [[] for _ in ids]
        for d in raw:
            text = m.decode(d["tokens"].tolist(), skip_special=True) if m._m.has_tokenizer else None
            out[d["prompt_index"]].append(Sample(d["prompt_index"], d["sample_index"], d["tokens"], d["logprobs"],
                                                 d["finish_reason"], text, d["routing"]))
        return out


LossFn = Callable[[list, list], tuple]


class Trainer:
    """forward / forward_backward / optim_step on the model's weights (Tinker's training calls). Gradients add up
    over forward_backward calls until optim_step applies them."""

    def __init__(self, model: "Model"):
        self._model = model

    def forward(self, batch: list, entropy: bool = False, temperature: float = 1.0, max_tokens: int = 8192) -> list:
        """Per datum: {"logprobs": float32 [response tokens], "entropy": ... or None} under the current weights."""
        return self._model._m.forward(list(batch), bool(entropy), float(temperature), int(max_tokens))

    def forward_backward(self, batch: list, loss: Union[str, LossFn] = "cross_entropy", **options) -> dict:
        """The loss's gradients, added to the accumulated ones. loss: "cross_entropy" (-sum w logp over the
        response tokens), "ppo" / "gspo" / "pg" (rl/policy_loss.h: advantages and the sampler's logprobs in each
        datum; options clip_low, clip_high, dual_clip, kl_coef, kl, entropy_coef, aggregation), or a function
        fn(logprobs, batch) -> (loss, grads): logprobs a float32 array per datum, grads d loss / d logprob per
        token (same shapes); the engine back-propagates them. Options: temperature, max_tokens (per micro-batch).
        Returns {"loss", "tokens", ...}."""
        batch = list(batch)
        if callable(loss):
            return self._custom(batch, loss, options)
        return self._model._m.forward_backward(batch, str(loss), dict(options))

    def forward_backward_custom(self, batch: list, loss_fn: LossFn, **options) -> dict:
        return self._custom(list(batch), loss_fn, options)

    def _custom(self, batch: list, fn: LossFn, options: dict) -> dict:
        import numpy as np

        temperature = float(options.get("temperature", 1.0))
        max_tokens = int(options.get("max_tokens", 8192))
        logprobs = [r["logprobs"] for r in self.forward(batch, temperature=temperature, max_tokens=max_tokens)]
        result = fn(logprobs, batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError("the loss function must return (loss, grads): a number and one array per datum")
        value, grads = result
        if len(grads) != len(batch):
            raise ValueError(f"the loss function returned {len(grads)} gradient arrays for {len(batch)} data")
        linear = []
        for i, (d, g) in enumerate(zip(batch, grads)):
            g = np.asarray(g, dtype=np.float32).reshape(-1)
            if g.shape[0] != len(d["response"]):
                raise ValueError(f"grads[{i}] has {g.shape[0]} values for {len(d['response'])} response tokens")
            e = {k: v for k, v in d.items() if k in ("prompt", "response", "mask", "routing")}
            e["weights"] = g
            linear.append(e)
        out = self._model._m.forward_backward(linear, "linear", {"temperature": temperature, "max_tokens": max_tokens})
        out["loss"] = float(value)
        return out

    def optim_step(self, params: AdamParams = AdamParams()) -> dict:
        """AdamW on the accumulated gradients (clipped to params.grad_clip): {"grad_norm", "clip_scale",
        "skipped", "step"}. The sampler sees the new weights at once."""
        return self._model._m.optim_step(params.learning_rate, params.beta1, params.beta2, params.eps,
                                         params.weight_decay, params.grad_clip)

    def save_state(self, dir: str) -> str:
        """Weights and optimizer state as DIR/checkpoint-STEP (the format `moetrain grpo --resume` writes, HF
        weights included); returns that directory."""
        return self._model._m.save_state(str(dir))

    def load_state(self, checkpoint: str) -> None:
        """Weights, optimizer state and step from a save_state checkpoint (any layout wrote it)."""
        self._model._m.load_state(str(checkpoint))

    def save_weights_for_sampler(self) -> int:
        """The sampler reads the trainer's weights in place, so there is nothing to copy: returns the step whose
        weights it samples from (Tinker's call, kept for loops written against it)."""
        return self._model._m.step

    def export_hf(self, dir: str, merge: bool = False, dtype: str = "bf16") -> str:
        """A clean Hugging Face model directory in bf16 or f32 (LoRA: the PEFT adapter, or with merge=True the
        merged model)."""
        return self._model._m.export_hf(str(dir), bool(merge), str(dtype))


class Model:
    """A Qwen3-MoE (or dense Qwen3) model: a directory with config.json (HF weights, tokenizer.json when present)
    or a preset name (random init at `seed`). device: "cpu", "cuda" or "auto". lora: a LoraConfig to train
    adapters on the frozen base. mesh: under `moetrain launch` or torchrun, the layout of the launched ranks, e.g.
    {"dp_shard": 2} or {"ep": 2} (every rank runs the same script). tokenizer: with a preset, a tokenizer.json
    whose ids the vocabulary is widened to hold (its <|im_end|> the EOS), as `moetrain sft --tokenizer`."""

    def __init__(self, path: str = "tiny", device: str = "auto", lora: Optional[LoraConfig] = None, seed: int = 0,
                 mesh: Optional[dict] = None, tokenizer: Optional[str] = None):
        if lora is not None and not isinstance(lora, LoraConfig):
            raise TypeError("lora must be a moetrain.LoraConfig")
        lc = lora or LoraConfig(rank=0)
        self._m = _load_model(str(path), str(device), int(lc.rank), float(lc.alpha), str(lc.targets), int(seed),
                              dict(mesh or {}), str(tokenizer or ""))
        self.sampler = Sampler(self)
        self.trainer = Trainer(self)

    def encode(self, text: str) -> list:
        return self._m.encode(text)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._m.decode([int(t) for t in ids], skip_special)

    def __getattr__(self, name):  # device, vocab_size, eos_token_id, num_layers, step, rank, world_size, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._m, name)

    def __repr__(self):
        return f"moetrain.Model({self._m.source!r}, device={self._m.device!r}, step={self._m.step})"
