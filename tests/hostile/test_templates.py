"""Chat-template bombs: refused within the render budget, never a hang or an exhausted memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

BASE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
BOMBS = {
    "lipsum": "{{ lipsum(100000, false, 100, 200) }}",
    "repetition": "{{ 'x' * 10**12 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "constant power": "{{ 9 ** 999999999 }}",
    "power at render": "{% set n = 999999999 %}{{ 9 ** n }}",
    "doubling": "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "macro recursion": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x', 60) }}",
    "width": "{{ 'x'|center(1000000000) }}",
}
PROGRAM = """
import sys
from sftaudit.dataset.render import Renderer
from sftaudit.errors import InputError
import jinja2
try:
    Renderer(sys.argv[1]).render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
except (InputError, jinja2.TemplateError) as exc:
    print(exc)
    sys.exit(2)
print("rendered")
"""


@pytest.mark.parametrize("name", BOMBS)
def test_a_template_bomb_exceeds_its_budget(name):
    # A subprocess with a memory cap: a bomb that escaped the budget would die there, not fill the machine.
    capped = "import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n" + PROGRAM
    done = subprocess.run(
        [sys.executable, "-c", capped, BOMBS[name] + BASE], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip().startswith("chat template exceeded its render budget")
    assert len(done.stdout.strip().splitlines()) == 1


def test_a_plain_template_renders_as_before():
    from sftaudit.dataset.render import Renderer

    text, _ = Renderer(BASE).render([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi<|end|>"


@pytest.mark.slow  # a run audited in a subprocess
@pytest.mark.parametrize("bomb", ["nested ranges", "constant power"])
def test_a_run_whose_tokenizer_carries_a_bomb_fails_naming_the_budget(tmp_path, bomb):
    """The audit of a run whose saved tokenizer has a hostile template: LOOP-01 fails it with the budget
    named (LOOP-02 cannot read its markers: not run), in bounded time (it hung in CI before)."""
    from sftaudit.fixtures import build_tokenizer

    from .builders import audit, trainer_run

    run = trainer_run(tmp_path)
    tokenizer = build_tokenizer(tmp_path / "tok")
    tokenizer.chat_template = BOMBS[bomb] + BASE + "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    tokenizer.save_pretrained(str(run / "checkpoint-20"))
    done = audit(run)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "LOOP-01 fail run: chat template exceeded its render budget" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # preflight in a subprocess
def test_preflight_with_a_bomb_template_fails_naming_the_budget(tmp_path):
    from sftaudit.fixtures import build_tokenizer

    from .builders import preflight

    build_tokenizer(tmp_path / "cache").save_pretrained(str(tmp_path / "tok"))
    (tmp_path / "bomb.jinja").write_text(BOMBS["nested ranges"] + BASE)
    done = preflight(tmp_path, tmp_path / "tok", "--template", str(tmp_path / "bomb.jinja"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "LOOP-01 fail run: chat template exceeded its render budget (over 2000000 steps)" in done.stdout
    assert "TemplateBudget" not in done.stdout and "Traceback" not in done.stderr
