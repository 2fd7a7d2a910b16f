"""A command imports only what it uses: `--help` and preflight never load scipy, plotly or the eval-metric
libraries (scipy.stats and rouge-score alone cost seconds of a preflight's fixed cost), because the checks
that need them import them inside the code that runs them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sftaudit.fixtures import build_tokenizer, load_dataset

# Modules no check module may import at module level (the registry imports every check), nor preflight
# (pandas: pyarrow's `pa.array` imports it on its first call when it is installed, 0.5 s).
HEAVY = ("scipy", "plotly", "rouge_score", "sacrebleu", "nltk", "pandas")


def loaded_after(script: str, watched=HEAVY) -> set[str]:
    """The top-level packages of `watched` that a fresh interpreter holds after running `script`."""
    probe = (
        f"{script}\nimport sys, json\n"
        f"print('LOADED', json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(watched)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.rsplit("LOADED", 1)[1]))


def test_help_and_the_check_registry_import_no_scipy_or_plotly():
    assert (
        loaded_after(
            "import contextlib, io\nfrom sftaudit.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
        )
        == set()
    )
    # Every check module imported, as preflight and gate do to learn the codes: still none of them.
    assert loaded_after("from sftaudit.checks import registered_checks\nassert len(registered_checks()) > 20") == set()


def test_preflight_imports_no_scipy_or_plotly(tmp_path):
    build_tokenizer(tmp_path / "tokenizer")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in load_dataset()[:8]), encoding="utf-8")
    script = (
        "from sftaudit.cli import main\n"
        f"assert main(['preflight', '--data', {str(data)!r}, '--tokenizer', {str(tmp_path / 'tokenizer')!r}, "
        f"'--out', {str(tmp_path / 'out')!r}, '--no-report', '--quiet']) == 0\n"
    )
    assert loaded_after(script) == set()
    # A bare tokenizer.json folder loads without AutoTokenizer, whose model configurations import torch.
    assert loaded_after(script, ("torch",)) == set()


@pytest.mark.parametrize("family", ["fixture", "llama3", "qwen2"])
def test_a_bare_tokenizer_folder_loads_as_autotokenizer_loads_it(tmp_path, family, monkeypatch):
    from transformers import AutoTokenizer

    from sftaudit.core.tokenizer import describe_tokenizer, load_saved_tokenizer

    if family == "fixture":
        build_tokenizer(tmp_path)
        folder = tmp_path
    else:  # released vocabularies, saved as transformers saves them (tokenizer.json + tokenizer_config.json)
        from .corpus import real_tokenizer, tokenizer_cache

        real_tokenizer(family, tokenizer_cache())
        folder = tokenizer_cache() / family
    # transformers json-loads the whole tokenizer.json in Python for its added tokens alone (the vocabulary
    # parsed twice: 0.45 s on Llama 3's); the direct load reads them from the file's head.
    loaded, json_load = [], json.load
    monkeypatch.setattr(json, "load", lambda f, *a, **k: loaded.append(Path(f.name).name) or json_load(f, *a, **k))
    direct = load_saved_tokenizer(folder)
    assert "tokenizer.json" not in loaded
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert "tokenizer.json" in loaded  # what the direct load skips, and would repeat if it went through it
    monkeypatch.undo()
    assert type(direct) is type(auto) and describe_tokenizer(direct) == describe_tokenizer(auto)
    assert direct.init_kwargs == auto.init_kwargs and direct.model_max_length == auto.model_max_length
    assert direct.added_tokens_decoder == auto.added_tokens_decoder
    assert direct.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    text = load_dataset()[0]["messages"][0]["content"] + f" {auto.eos_token}"
    assert direct(text)["input_ids"] == auto(text)["input_ids"]


def test_the_added_tokens_are_left_to_transformers_where_the_head_of_tokenizer_json_cannot_give_them(tmp_path):
    from transformers import AutoTokenizer

    from sftaudit.core.tokenizer import _added_tokens_decoder, describe_tokenizer, load_saved_tokenizer

    build_tokenizer(tmp_path)
    assert set(_added_tokens_decoder(tmp_path)) == {"added_tokens_decoder"}
    text = (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    # A repeated key (the last one counts in both parsers), and the legacy file transformers merges itself.
    (tmp_path / "tokenizer.json").write_text(text.replace("{", '{"added_tokens": [],', 1), encoding="utf-8")
    assert _added_tokens_decoder(tmp_path) == {}
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|eot_id|>"}), encoding="utf-8")
    assert _added_tokens_decoder(tmp_path) == {}
    direct, auto = load_saved_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert describe_tokenizer(direct) == describe_tokenizer(auto) and direct.init_kwargs == auto.init_kwargs


def test_auditing_a_trainer_log_imports_no_scipy_jinja2_or_torch(tmp_path):
    """A log-only run (a trainer_state.json) is audited in well under a second of CPU: no check pays for scipy.stats
    (most of a second) before it has a finding to give a p-value, and nothing parses a chat template the run does
    not have (jinja2). Torch is never the analyzer's."""
    from .checks.logged_runs import falling, trainer_run

    loss = falling(400)
    run = trainer_run(tmp_path / "run", loss, grad_norm=1.0 + loss, evals=[(100, 1.5), (200, 1.2), (300, 1.1)])
    script = (
        "from sftaudit.cli import main\n"
        f"assert main(['audit', {str(run)!r}, '--out', {str(tmp_path / 'out')!r}, '--no-report']) in (0, 1)\n"
    )
    assert loaded_after(script, (*HEAVY, "jinja2", "torch")) == set()


def test_the_normal_tail_without_scipy_is_scipys():
    from scipy import stats

    from sftaudit.checks.stats.rolling import normal_sf

    z = np.concatenate([np.linspace(-40, 40, 801), [0.0, 1e-9, 37.5, 38.5, np.inf, -np.inf]])
    assert np.allclose([normal_sf(v) for v in z], stats.norm.sf(z), rtol=1e-12, atol=1e-300)
    assert math.isnan(normal_sf(math.nan))
