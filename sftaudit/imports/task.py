"""What an imported run trained: the model (from its ``config.json``, else the PEFT ``adapter_config.json``) and the
objective (from the keys its log holds). The manifest's ``task``: checks judge a classifier's loss against
ln(number of labels), a language model's against ln(vocabulary), a preference or RL loss as what it is."""

from __future__ import annotations

from typing import Any

# The head an architecture's class name ends with -> the task it trains.
HEADS = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForMultipleChoice", "multiple_choice"),
    ("ForMaskedLM", "masked_lm"),
    ("ForCTC", "ctc"),
    ("ForSpeechSeq2Seq", "seq2seq"),
    ("ForImageClassification", "sequence_classification"),
    ("ForAudioClassification", "sequence_classification"),
)
# PEFT's task types (adapter_config.json) -> the task.
PEFT_TASKS = {
    "CAUSAL_LM": "causal_lm",
    "SEQ_2_SEQ_LM": "seq2seq",
    "SEQ_CLS": "sequence_classification",
    "TOKEN_CLS": "token_classification",
    "QUESTION_ANS": "question_answering",
}
CLASSIFIERS = {"sequence_classification", "token_classification", "multiple_choice"}
# Labels listed in the manifest at most (a classifier of thousands of classes is named by its count).
MAX_LABELS = 100
# A config's default id2label (PretrainedConfig leaves it out of config.json): two labels.
DEFAULT_NUM_LABELS = 2


def describe_task(config: dict[str, Any] | None, adapter: dict[str, Any] | None, keys: set[str]) -> dict[str, Any]:
    """``kind`` (causal_lm, seq2seq, sequence_classification, token_classification, question_answering,
    multiple_choice, masked_lm, ctc; None: unknown), ``architecture``, ``model_type``, ``is_encoder_decoder``,
    ``num_labels``, ``labels`` and ``problem_type`` (a classifier), ``vocab_size``, ``adapter`` (PEFT: task
    type, base model), ``objective`` (dpo, orpo, kto, cpo, grpo, ppo; None: plain supervised), ``family``
    (sft, preference, rl) and ``objective_keys`` (the logged keys that named it)."""
    config = config if isinstance(config, dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    architecture = architecture if isinstance(architecture, str) else None
    encoder_decoder = config.get("is_encoder_decoder")
    encoder_decoder = encoder_decoder if isinstance(encoder_decoder, bool) else None
    kind = _kind(architecture, encoder_decoder)
    peft = None
    if isinstance(adapter, dict):
        peft = {
            "task_type": _text(adapter.get("task_type")),
            "base_model": _text(adapter.get("base_model_name_or_path")),
        }
        kind = kind or PEFT_TASKS.get(peft["task_type"] or "")
    vocab = next((v for v in (config.get("vocab_size"), text.get("vocab_size")) if _count(v)), None)
    objective, family, named = objective_of(keys)
    return {
        "kind": kind,
        "architecture": architecture,
        "model_type": _text(config.get("model_type")),
        "is_encoder_decoder": encoder_decoder,
        **_labels(config, kind),
        "vocab_size": vocab,
        "adapter": peft,
        "objective": objective,
        "family": family,
        "objective_keys": named,
    }


def objective_of(keys: set[str]) -> tuple[str | None, str, list[str]]:
    """The training objective the log's statistics name (TRL's trainers, LLaMA-Factory's), its family, and the keys
    that named it. RL trainers first: GRPO logs per-reward ``rewards/<function>/mean`` beside its ``kl``."""

    def having(*tests) -> list[str]:
        return sorted(k for k in keys if any(k == t or (t.endswith("/") and k.startswith(t)) for t in tests))

    rules = (
        ("ppo", "rl", ("objective/", "ppo/", "policy/")),
        ("grpo", "rl", ("reward_std", "frac_reward_zero_std", "completions/", "clip_ratio/")),
        ("orpo", "preference", ("log_odds_ratio", "log_odds_chosen", "odds_ratio_loss")),
        ("kto", "preference", ("count/", "rewards/chosen_sum", "logps/chosen_sum")),
        ("dpo", "preference", ("rewards/", "logps/", "logits/")),
    )
    for name, family, tests in rules:
        named = having(*tests)
        if not named:
            continue
        if name == "dpo" and "kl" in keys:
            return "kto", family, sorted(named + ["kl"])  # older KTO: rewards and logps with a KL estimate
        if name == "dpo" and "nll_loss" in keys:
            return "cpo", family, sorted(named + ["nll_loss"])  # CPO / SimPO add the chosen NLL
        return name, family, named
    return None, "sft", []


def _kind(architecture: str | None, encoder_decoder: bool | None) -> str | None:
    if architecture is None:
        return None
    if architecture.endswith("ForConditionalGeneration"):
        # T5, BART, Whisper (encoder-decoder) -- or a multimodal decoder (Llava, Qwen2-VL, Gemma 3)
        return "seq2seq" if encoder_decoder else "causal_lm"
    return next((kind for head, kind in HEADS if architecture.endswith(head)), None)


def _labels(config: dict[str, Any], kind: str | None) -> dict[str, Any]:
    if kind not in CLASSIFIERS:
        return {"num_labels": None, "labels": None, "problem_type": None}
    id2label = config.get("id2label")
    labels = None
    if isinstance(id2label, dict) and id2label:
        ordered = sorted(id2label.items(), key=lambda kv: int(kv[0]) if str(kv[0]).lstrip("-").isdigit() else 0)
        labels = [str(v)[:100] for _, v in ordered]
    count = len(labels) if labels else config.get("num_labels") if _count(config.get("num_labels")) else None
    return {
        "num_labels": count or DEFAULT_NUM_LABELS,
        "labels": labels[:MAX_LABELS] if labels else None,
        "problem_type": _text(config.get("problem_type")),
    }


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _text(value: Any) -> str | None:
    return value[:200] if isinstance(value, str) else None
