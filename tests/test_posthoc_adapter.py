"""`sftaudit probe` on a PEFT adapter checkpoint: the adapter is applied from its JSON config and
safetensors weights alone, as PEFT's own loader applies it, and a pickled adapter is refused."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from sftaudit.fixtures import build_model, build_tokenizer  # noqa: E402

from sftaudit.errors import InputError  # noqa: E402
from sftaudit.shim.posthoc import _load_model  # noqa: E402


@pytest.fixture(scope="module")
def adapter_checkpoint(tmp_path_factory, tokenizer_cache):
    root = tmp_path_factory.mktemp("adapter")
    base = build_model(build_tokenizer(tokenizer_cache))
    base.save_pretrained(root / "base")
    tuned = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    tuned.save_pretrained(root / "checkpoint-10")  # safetensors, as the Trainer saves adapters
    return root


def test_the_adapter_is_applied_as_peft_applies_it(adapter_checkpoint):
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    ours = _load_model(adapter_checkpoint / "checkpoint-10", adapter_checkpoint / "base")
    base = type(ours.get_base_model()).from_pretrained(adapter_checkpoint / "base", dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, str(adapter_checkpoint / "checkpoint-10")).eval()
    plain = type(base).from_pretrained(adapter_checkpoint / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        got, want, without = (m(input_ids=ids).logits for m in (ours, reference, plain))
    assert torch.equal(got, want)
    assert not torch.allclose(got, without)  # the adapter changed the model: it was really applied


def test_a_pickled_adapter_is_refused(adapter_checkpoint, tmp_path):
    pickled = tmp_path / "checkpoint-20"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes(
        (adapter_checkpoint / "checkpoint-10" / "adapter_config.json").read_bytes()
    )
    (pickled / "adapter_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(InputError, match="adapter_model.safetensors"):
        _load_model(pickled, adapter_checkpoint / "base")
