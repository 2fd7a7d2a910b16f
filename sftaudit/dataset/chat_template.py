"""Chat-template analysis for the data-layer checks (LOOP-01/02/04) and `preflight`. No torch.

Three things, all derived from the template itself, never from hard-coded marker strings:

* `template_fields`: what the template reads from a message and from its context, walking
  jinja2's own AST (message aliases followed through ``for``/``set``).
* `Renderer`: the template rendered by transformers' own machinery (byte-equal with
  ``apply_chat_template(..., tokenize=False)``), with the ``{% generation %}`` spans as
  character offsets when the template has them.
* `TemplateLayout`: the token-id sequences that open each role's turn and end a turn,
  found by rendering sentinel conversations and diffing the text; `expected_labels`
  uses them to say, for every position of a token row, whether it should be trained.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes as nodes
import jinja2.sandbox
import numpy as np

from ..core.tokenizer import TokenizerRefused, load_saved_tokenizer
from ..errors import InputError, one_line

IGNORE_INDEX = -100
MASKED, TRAINED, PADDING, EITHER = 0, 1, 2, 3
CATEGORY_NAMES = ("masked", "trained", "padding", "either")
# Tests that make a field read optional: `message.tool_calls is defined`, `... is none`.
_OPTIONAL_TESTS = {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"}
_CHAT_ROLES = {"system", "user", "assistant", "role"}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SENTINEL = {
    "system": "SFTAUDITSYSTEMSENTINEL",
    "user": "SFTAUDITUSERSENTINEL",
    "assistant": "SFTAUDITASSISTANTSENTINEL",
}


def template_source(chat_template: Any) -> str | None:
    """The default template text (tokenizers may carry a dict of named templates)."""
    if isinstance(chat_template, dict):
        return chat_template.get("default") or next(iter(chat_template.values()), None)
    if isinstance(chat_template, list):  # the serialised form: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return chat_template or None


# --------------------------------------------------------------------------- AST


@functools.cache
def _internals() -> tuple[Any, Any]:
    """transformers' compiled chat template (the environment, globals, filters and `generation` tag
    `apply_chat_template` uses) and its span tracker. Both are private, so a version without them
    gives (None, None): templates are then parsed with a look-alike environment and rendered through
    the public `render_jinja_template` (the same text, slower)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template, _render_with_assistant_indices
    except ImportError:
        return None, None
    return _compile_jinja_template, _render_with_assistant_indices


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` parsed as transformers parses it (for the AST only)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


# transformers' environment options, for parsing when its own compiled template is not available.
_PARSE_ENVIRONMENT = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
)
_PARSE_ENVIRONMENT.globals.update(dict.fromkeys(("raise_exception", "strftime_now")))  # its globals: not context


def _compiled(source: str) -> jinja2.Template | None:
    """The template as transformers compiles it, in a budgeted sandbox (None without its private
    compiler); a syntax error is bad input."""
    compile_template, _ = _internals()
    try:
        if compile_template is None:
            _PARSE_ENVIRONMENT.parse(source)
            return None
        return _budgeted(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"chat template does not parse: {one_line(exc)}") from None


# --------------------------------------------------------------------------- render budget

# Budgets of one render (one conversation): far above any real one (a 128k-token chat is ~600k characters).
MAX_RENDER_CHARS = 4_000_000
MAX_RENDER_STEPS = 2_000_000  # attribute reads, calls, operators and loop iterations
MAX_RENDER_SECONDS = 10.0
_MAX_POWER_BITS = 1 << 16  # an integer power's result; 9 ** 999999999 would take minutes and 400 MB
_BIG_FORMAT = re.compile(r"%[-+ #0]*(\*|\d{7,})|%[-+ #0]*\d*\.(\*|\d{7,})|\{[^{}]*?\d{7,}[^{}]*\}")
_BUDGET = threading.local()


class TemplateBudget(jinja2.exceptions.SecurityError):
    """A chat template over its render budget (output size, steps, time) or asking for a huge value."""

    def __init__(self, why: str):
        super().__init__(f"chat template exceeded its render budget ({why})")


class TemplateOverBudget(InputError):
    """TemplateBudget as the analyzer reports it: never taken for "a template without turns"."""


def _tick() -> None:
    budget = getattr(_BUDGET, "left", None)
    if budget is None:  # compile-time constant folding: sizes are still checked, steps are not counted
        return
    budget[0] -= 1
    if budget[0] < 0:
        raise TemplateBudget(f"over {MAX_RENDER_STEPS} steps")
    if not budget[0] % 1024 and time.monotonic() > budget[1]:
        raise TemplateBudget(f"over {MAX_RENDER_SECONDS:.0f} s")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _guard_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operator whose result would be huge, before computing it."""
    if operator == "+":  # first: nearly every binop of a chat template is a string concatenation
        if _sized(left) + _sized(right) > MAX_RENDER_CHARS:
            raise TemplateBudget(f"a concatenation of {_sized(left) + _sized(right)} items")
        return
    ints = [type(v) is int for v in (left, right)]
    if operator == "**" and all(ints) and right > 0 and abs(left) > 1 and right * left.bit_length() > _MAX_POWER_BITS:
        raise TemplateBudget(f"{left} ** {right} is too large")
    if operator == "*":
        if all(ints) and left.bit_length() + right.bit_length() > _MAX_POWER_BITS:
            raise TemplateBudget("an integer product is too large")
        count, seq = (left, right) if ints[0] else (right, left)
        if type(count) is int and count > 0 and _sized(seq) * count > MAX_RENDER_CHARS:
            raise TemplateBudget(f"a repetition of {_sized(seq) * count} items")
    if operator == "%" and isinstance(left, str) and _BIG_FORMAT.search(left):
        raise TemplateBudget("a format with a huge width")


def _guard_call(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if type(value) is int and value > MAX_RENDER_CHARS:
            raise TemplateBudget(f"a call with the argument {value}")
        if _sized(value) > MAX_RENDER_CHARS:
            raise TemplateBudget(f"a call with an argument of {_sized(value)} items")


def _guard_result(value: Any) -> Any:
    if _sized(value) > MAX_RENDER_CHARS:
        raise TemplateBudget(f"a value of {_sized(value)} items")
    return value


def _budgeted_callable(func: Any) -> Any:
    """A filter or global with its arguments and result size-checked (the wrapper keeps jinja's
    pass_context/pass_eval_context marks)."""

    @functools.wraps(func)
    def checked(*args, **kwargs):
        _tick()
        _guard_call(args[1:] if getattr(func, "jinja_pass_arg", None) else args, kwargs)
        if (
            func is _LIPSUM
            and (args[0] if args else kwargs.get("n", 5)) * (args[3] if len(args) > 3 else kwargs.get("max", 100))
            > 10_000
        ):
            raise TemplateBudget("lipsum asked for over 10000 words")
        return _guard_result(func(*args, **kwargs))

    return checked


_LIPSUM = jinja2.utils.generate_lorem_ipsum


class _Counted:
    """A for-loop's iterable that counts each iteration against the render's step budget."""

    def __init__(self, iterable: Any):
        self.iterable = iterable

    def __iter__(self):
        for item in self.iterable:
            _tick()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)


@jinja2.pass_context  # never folded at compile time
def _count_iterations(_context: Any, iterable: Any) -> _Counted:
    return _Counted(iterable)


@jinja2.pass_context
def _concat(_context: Any, parts: list) -> str:
    _tick()
    pieces = [str(p) for p in parts]
    if sum(map(len, pieces)) > MAX_RENDER_CHARS:
        raise TemplateBudget(f"a concatenation of {sum(map(len, pieces))} characters")
    return "".join(pieces)


class _BudgetEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with a budget: the operators that can blow up (`**`, `*`, `+`,
    `%`) are intercepted, so jinja never folds them at compile time and checks them at render time;
    every call, attribute read and loop iteration counts against the steps and the clock."""

    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _tick()
        _guard_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _tick()
        _guard_call(args, kwargs)
        if (
            getattr(__obj, "__name__", None) in ("format", "format_map")
            and isinstance(getattr(__obj, "__self__", None), str)
            and _BIG_FORMAT.search(__obj.__self__)
        ):
            raise TemplateBudget("a format with a huge width")
        return _guard_result(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def _generate(self, source, name, filename, defer_init=False):
        for loop in list(source.find_all(nodes.For)):
            loop.iter = nodes.Filter(loop.iter, "_sftaudit_count", [], [], None, None, lineno=loop.lineno)
        # `a ~ b` compiles to a plain join nothing intercepts: a doubling loop would fill memory.
        for concat in list(source.find_all(nodes.Concat)):
            parts = nodes.List(concat.nodes, lineno=concat.lineno)
            concat.nodes = [nodes.Filter(parts, "_sftaudit_concat", [], [], None, None, lineno=concat.lineno)]
        return super()._generate(source, name, filename, defer_init=defer_init)


@functools.lru_cache(maxsize=32)
def _budgeted(source: str) -> jinja2.Template:
    """`source` compiled as transformers compiles it (its options, extensions, filters and globals,
    taken from its own compiled environment), in `_BudgetEnvironment`."""
    compile_template, _ = _internals()
    theirs = compile_template("").environment
    env = _BudgetEnvironment(
        trim_blocks=theirs.trim_blocks,
        lstrip_blocks=theirs.lstrip_blocks,
        extensions=[type(e) for e in theirs.extensions.values()],
    )
    for mine, given in ((env.filters, theirs.filters), (env.globals, theirs.globals)):
        mine.update({k: v for k, v in given.items() if mine.get(k) is not v})
        mine.update(
            {
                k: _budgeted_callable(v)
                for k, v in mine.items()
                if isinstance(v, (types.FunctionType, types.BuiltinFunctionType))
            }
        )
    env.filters.update(_sftaudit_count=_count_iterations, _sftaudit_concat=_concat)
    _refuse_constant_bombs(env.parse(source))
    return env.from_string(source)


def _refuse_constant_bombs(ast: nodes.Template) -> None:
    """Constant expressions checked as the budget would at render time. The template may also be
    compiled by transformers itself (`render_jinja_template`), whose jinja folds constants at compile
    time: `9 ** 999999999` would hang there."""

    def fold(node):
        if isinstance(node, nodes.Const):
            return node.value
        if isinstance(node, nodes.BinExpr):
            left, right = fold(node.left), fold(node.right)
            _guard_binop(node.operator, left, right)
            return jinja2.nodes._binop_to_func[node.operator](left, right)
        if isinstance(node, (nodes.Neg, nodes.Pos)):
            return -fold(node.node) if isinstance(node, nodes.Neg) else fold(node.node)
        raise nodes.Impossible()

    for node in ast.find_all(nodes.BinExpr):
        try:
            fold(node)
        except TemplateBudget:
            raise TemplateOverBudget(str(TemplateBudget(f"a constant expression at line {node.lineno}"))) from None
        except (nodes.Impossible, ArithmeticError, TypeError, ValueError):
            pass
    for node in ast.find_all((nodes.Call, nodes.Filter)):
        for arg in [*node.args, *(k.value for k in node.kwargs)]:
            if isinstance(arg, nodes.Const) and type(arg.value) is int and arg.value > MAX_RENDER_CHARS:
                raise TemplateOverBudget(
                    str(TemplateBudget(f"a call with the argument {arg.value} at line {node.lineno}"))
                )


def _render_budgeted(template: jinja2.Template, blocks: list[str] | None = None, **context: Any) -> str:
    """One render within MAX_RENDER_CHARS / MAX_RENDER_STEPS / MAX_RENDER_SECONDS (no signals or threads:
    the sandbox counts)."""
    blocks = [] if blocks is None else blocks
    _BUDGET.left = [MAX_RENDER_STEPS, time.monotonic() + MAX_RENDER_SECONDS]
    try:
        size = 0
        for block in template.generate(**context):
            size += len(block)
            if size > MAX_RENDER_CHARS:
                raise TemplateBudget(f"output over {MAX_RENDER_CHARS} characters")
            blocks.append(block)
        return "".join(blocks)
    finally:
        _BUDGET.left = None


def _parse(source: str) -> nodes.Template:
    compiled = _compiled(source)
    return (compiled.environment if compiled is not None else _PARSE_ENVIRONMENT).parse(source)


def has_generation_block(source: str | None) -> bool:
    """The template marks its assistant turns with `{% generation %}` (what transformers' assistant mask and
    TRL's assistant_only_loss read)."""
    return bool(source) and bool(_GENERATION_TAG.search(source))


@dataclass
class TemplateFields:
    message_required: set[str] = field(default_factory=set)
    message_optional: set[str] = field(default_factory=set)
    context: set[str] = field(default_factory=set)
    literals: set[str] = field(default_factory=set)


def template_fields(source: str) -> TemplateFields:
    """Every field the template reads from a message (required unless only tested/`.get`),
    the context variables it reads, and its literal strings (for LOOP-02's markers)."""
    return copy.deepcopy(_template_fields(source))  # a copy: callers may change theirs


@functools.lru_cache(maxsize=8)
def _template_fields(source: str) -> TemplateFields:  # LOOP-01, LOOP-02 and the preview each ask: one walk
    ast = _parse(source)
    lists, messages = {"messages"}, set()
    assignments = [(n.target, n.iter, True) for n in ast.find_all(nodes.For)]
    assignments += [(n.target, n.node, False) for n in ast.find_all(nodes.Assign)]

    def is_list(e):
        if isinstance(e, nodes.Name):
            return e.name in lists
        if isinstance(e, nodes.Getitem):
            return isinstance(e.arg, nodes.Slice) and is_list(e.node)
        if isinstance(e, nodes.Filter):
            return e.node is not None and is_list(e.node)
        return False

    def is_message(e):
        if isinstance(e, nodes.Name):
            return e.name in messages
        if isinstance(e, nodes.Getitem):
            return not isinstance(e.arg, nodes.Slice) and is_list(e.node)
        return False

    for _ in range(3):  # aliases of aliases: a fixpoint in a few passes
        for target, value, loops in assignments:
            if isinstance(target, nodes.Name):
                if loops and is_list(value):
                    messages.add(target.name)
                elif not loops and is_list(value):
                    lists.add(target.name)
                elif not loops and is_message(value):
                    messages.add(target.name)

    assigned = {n.name for n in ast.find_all(nodes.Name) if n.ctx == "store"}
    out = TemplateFields(context=set(jinja2.meta.find_undeclared_variables(ast)) - assigned)
    out.literals = {n.data for n in ast.find_all(nodes.TemplateData)}
    out.literals |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}

    def field_read(node):
        if (
            isinstance(node, nodes.Getitem)
            and is_message(node.node)
            and isinstance(node.arg, nodes.Const)
            and isinstance(node.arg.value, str)
        ):
            return node.arg.value
        if (
            isinstance(node, nodes.Getattr)
            and is_message(node.node)
            and node.attr not in ("get", "items", "keys", "values")
        ):
            return node.attr
        return None

    def truthy_reads(test):
        """Fields a condition reads as a bare truth value (`if m.tool_calls`, `not m.x`, `a and m.y`)."""
        if isinstance(test, (nodes.And, nodes.Or)):
            return truthy_reads(test.left) | truthy_reads(test.right)
        if isinstance(test, nodes.Not):
            return truthy_reads(test.node)
        name = field_read(test)
        return {name} if name else set()

    def guarded_reads(test):
        """Fields a condition checks before it reads them further (`m.tool_calls is defined and
        m.tool_calls | length > 0`, `m.x and m.x[0]`): those reads are optional too."""
        checked = {field_read(t.node) for t in test.find_all(nodes.Test) if t.name in _OPTIONAL_TESTS}
        # Presence tests: `m.get('f', none) is not none and m['f'] | length`, `'f' in m and m['f']`.
        checked |= {
            c.args[0].value
            for c in test.find_all(nodes.Call)
            if isinstance(c.node, nodes.Getattr)
            and c.node.attr == "get"
            and is_message(c.node.node)
            and c.args
            and isinstance(c.args[0], nodes.Const)
        }
        checked |= {
            c.expr.value
            for c in [test, *test.find_all(nodes.Compare)]
            if isinstance(c, nodes.Compare)
            and isinstance(c.expr, nodes.Const)
            and any(op.op == "in" and is_message(op.expr) for op in c.ops)
        }
        return (checked - {None}) | truthy_reads(test)

    macros = {m.name: m for m in ast.find_all(nodes.Macro)}
    expanding: list[str] = []

    def visit(node, parent, conditional, guarded=frozenset()):
        """Reads under an `if` or inline `x if c else y` are optional, except under a plain dispatch
        on the message's role (`if message.role == 'user'`), which every row of that role takes. A macro's
        reads are judged where it is called (Kimi K2 reads `tool_calls` in a macro it calls only under
        `if message.get('tool_calls')`); a macro never called reads nothing."""
        if isinstance(node, nodes.Macro):
            return
        if (
            isinstance(node, nodes.Call)
            and isinstance(node.node, nodes.Name)
            and node.node.name in macros
            and node.node.name not in expanding
        ):
            expanding.append(node.node.name)
            for child in macros[node.node.name].body:
                visit(child, node, conditional, guarded)
            expanding.pop()
        if isinstance(node, (nodes.If, nodes.CondExpr)):
            test = node.test
            tested = {field_read(n) for n in [test, *test.find_all((nodes.Getitem, nodes.Getattr))]} - {None}
            tested |= {
                c.expr.value
                for c in [test, *test.find_all(nodes.Compare)]
                if isinstance(c, nodes.Compare)
                and isinstance(c.expr, nodes.Const)
                and any(op.op in ("in", "notin") and is_message(op.expr) for op in c.ops)
            }
            roles = {c.value for c in test.find_all(nodes.Const) if isinstance(c.value, str)}
            role_dispatch = (
                tested == {"role"}
                and roles <= _CHAT_ROLES
                and not any(n.name not in messages and n.name not in lists for n in test.find_all(nodes.Name))
            )
            out.message_optional.update(truthy_reads(test))
            visit(test, node, conditional, guarded | guarded_reads(test))
            branches = (
                [node.expr1, node.expr2] if isinstance(node, nodes.CondExpr) else node.body + node.elif_ + node.else_
            )
            for child in branches:
                if child is not None:
                    visit(child, node, conditional or not role_dispatch, guarded)
            return
        name = field_read(node)
        if (
            isinstance(node, nodes.Call)
            and isinstance(node.node, nodes.Getattr)
            and node.node.attr == "get"
            and is_message(node.node.node)
            and node.args
            and isinstance(node.args[0], nodes.Const)
        ):
            out.message_optional.add(node.args[0].value)
        elif (
            isinstance(node, nodes.Compare)
            and isinstance(node.expr, nodes.Const)
            and any(op.op in ("in", "notin") and is_message(op.expr) for op in node.ops)
        ):
            out.message_optional.add(node.expr.value)
        if name is not None:
            optional = (
                conditional
                or name in guarded
                or (isinstance(parent, nodes.Test) and parent.name in _OPTIONAL_TESTS)
                or (isinstance(parent, nodes.Filter) and parent.name in ("default", "d") and parent.node is node)
                or isinstance(parent, (nodes.Not, nodes.And, nodes.Or, nodes.If, nodes.CondExpr))
            )
            (out.message_optional if optional else out.message_required).add(name)
        for child in node.iter_child_nodes():
            visit(child, node, conditional, guarded)

    visit(ast, None, False)
    out.message_optional -= out.message_required
    return out


# --------------------------------------------------------------------------- rendering


class Renderer:
    """Render conversations exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does, with
    the `{% generation %}` spans when the template has them. A template that refuses a row
    (`raise_exception`) raises TemplateError.

    transformers normalises every conversation before rendering (objects to dicts, keys whose value is
    None dropped, everything rebuilt from plain JSON types, reasoning fields aliased). For a plain JSON
    row (what a JSONL file or a `datasets` row holds) without reasoning fields all of that but the None
    drop is the identity, so such rows go straight to the compiled template; any other row is normalised
    by transformers' own helpers first. Either way the template renders in the budgeted sandbox
    (`_BudgetEnvironment`); only a transformers without those private helpers falls back to
    `render_jinja_template` itself (constant bombs are still refused before it compiles the template).
    """

    def __init__(self, source: str, template_kwargs: dict[str, Any] | None = None):
        self.source = source
        self.kwargs = dict(template_kwargs or {})
        self.tracks_generation = bool(_GENERATION_TAG.search(source))
        self.compiled = _compiled(source)  # a syntax error is bad input, reported once
        # Values that are not plain JSON must go through transformers' normalisation.
        self.template = self.compiled if _is_json(self.kwargs) else None
        self.context = {"tools": None, "documents": None, **self.kwargs}
        self.over_budget: TemplateBudget | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
        # A template over its budget once is refused from then on: each row would spend the whole budget.
        if self.over_budget is not None:
            raise self.over_budget
        try:
            return self._render(messages, add_generation_prompt)
        except TemplateBudget as exc:
            self.over_budget = exc
            raise

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        chat = _plain_chat(messages) if self.template is not None else None
        context = self.context
        if chat is None and self.compiled is not None and _normalisers() is not None:
            plain, alias = _normalisers()  # what render_jinja_template does before it renders
            chat = plain(_without_none(messages))
            for message in chat:
                if not isinstance(message, dict):
                    raise TypeError(f"Chat messages should be dicts, but got {type(message).__name__}")
            chat, context = alias(chat), {"tools": None, "documents": None, **plain(self.kwargs)}
        if chat is None:
            from transformers.utils.chat_template_utils import render_jinja_template

            (text,), spans = render_jinja_template(
                [_without_none(messages)],
                chat_template=self.source,
                add_generation_prompt=add_generation_prompt,
                return_assistant_tokens_mask=self.tracks_generation,
                **self.kwargs,
            )
            return text, [tuple(s) for s in spans[0]] if spans else []
        if self.tracks_generation:  # as transformers' _render_with_assistant_indices, within the budget
            blocks, spans = [], []
            with self.compiled.environment.activate_tracker(blocks, spans):
                text = _render_budgeted(
                    self.compiled, blocks, messages=chat, add_generation_prompt=add_generation_prompt, **context
                )
            return text, [tuple(s) for s in spans]
        return _render_budgeted(
            self.compiled, messages=chat, add_generation_prompt=add_generation_prompt, **context
        ), []


@functools.cache
def _normalisers() -> tuple[Any, Any] | None:
    """transformers' conversation normalisation (private: None in a version without it)."""
    try:
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data
    except ImportError:
        return None
    return _plain_template_data, _alias_reasoning_fields


# Message fields transformers copies into one another before rendering (reasoning_content <-> thinking).
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_json(value: Any) -> bool:
    """Built from JSON types only (exact types: a str subclass is not plain)."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if kind is list:
        return all(map(_is_json, value))
    if kind is dict:
        return all(type(k) is str for k in value) and all(map(_is_json, value.values()))
    return False


def _plain_chat(messages: Any) -> list[dict] | None:
    """The messages as transformers hands a plain JSON row to the template (keys whose value is None
    dropped), or None when the row needs transformers' own normalisation."""
    if type(messages) is not list:
        return None
    chat = []
    for message in messages:
        if type(message) is not dict or not _REASONING_FIELDS.isdisjoint(message):
            return None
        plain = {}
        for key, value in message.items():
            if type(key) is not str or (type(value) is not str and not _is_json(value)):
                return None
            if value is not None:
                plain[key] = value
        chat.append(plain)
    return chat


def _without_none(messages: Any) -> Any:
    """apply_chat_template's first normalisation: message keys whose value is None dropped."""
    if not isinstance(messages, (list, tuple)):
        return messages
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


def tokenizer_specials(tokenizer: Any) -> dict[str, Any]:
    """What transformers passes to chat templates besides the messages: the special-tokens map."""
    return dict(getattr(tokenizer, "special_tokens_map", {}) or {})


# --------------------------------------------------------------------------- layout


@dataclass
class TemplateLayout:
    """Token-id markers of the template: where each role's turn opens and where a turn ends.

    Derived by rendering sentinel conversations, whether or not the template has
    `{% generation %}` markers: the end of turn is what follows an assistant message both
    when the chat ends there and when a user turn follows (so a final eos the template adds
    after the last turn is not part of it); a role's header is what sits between the end of
    the previous turn and that role's sentinel. Text a template inserts between the
    assistant header and the content (an empty thinking block) is `assistant_prefix`.
    Markers are tokenized in context (the tokens lying wholly inside the marker's text), so
    a SentencePiece word-start merged into the content is not part of them.
    """

    headers: dict[str, list[int]]
    turn_end: list[int]
    texts: dict[str, str]
    assistant_prefix: list[int] = field(default_factory=list)
    blank_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    eos_id: int | None = None
    starts_with_bos: bool = False  # the render opens with the BOS string: inference sends BOS first

    @classmethod
    def derive(cls, tokenizer: Any, source: str) -> TemplateLayout:
        renderer = Renderer(source, tokenizer_specials(tokenizer))
        s = _SENTINEL

        def render(*roles, prompt=False):
            try:
                return renderer.render([{"role": r, "content": s[r]} for r in roles], add_generation_prompt=prompt)
            except TemplateBudget as exc:
                raise TemplateOverBudget(str(exc)) from None
            except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError):
                return None, []  # the template refuses this shape of conversation

        def tokens(text, start, end):
            """(id, char start, char end) of `text`'s tokens lying wholly in [start, end): markers as
            tokenized in context."""
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return [(i, b, e) for i, (b, e) in zip(enc["input_ids"], enc["offset_mapping"]) if start <= b < e <= end]

        blank = _blank_ids(tokenizer)

        def trimmed(run):
            """The run without whitespace tokens at either end."""
            while run and blank[run[0][0]]:
                run = run[1:]
            while run and blank[run[-1][0]]:
                run = run[:-1]
            return run

        text_ua, spans = render("user", "assistant")
        if text_ua is None or s["assistant"] not in text_ua:
            raise InputError("the chat template does not render a user/assistant conversation with its content")
        a_start = text_ua.index(s["assistant"])
        a_end = a_start + len(s["assistant"])
        span = next(((b, e) for b, e in spans if b <= a_start < e), None)
        text_uau, _ = render("user", "assistant", "user")
        if text_uau is not None and (s["assistant"] not in text_uau or text_uau.count(s["user"]) != 2):
            text_uau = None
        # The end of turn, in tokens: the generation span's tail, else what follows the assistant's content
        # both when the chat ends there and when a user turn follows (a final eos is not part of it).
        # A generation span that ends before the marker: the marker is still what generation must learn
        # to emit, so it is found as without a span.
        run = trimmed(tokens(text_ua, a_end, span[1])) if span else []
        run_from_span = bool(run)
        if not run:
            run = tokens(text_ua, a_end, len(text_ua))
        if not run_from_span and text_uau:
            after = text_uau.index(s["assistant"]) + len(s["assistant"])
            following = tokens(text_uau, after, len(text_uau))
            common = 0
            while common < min(len(run), len(following)) and run[common][0] == following[common][0]:
                common += 1
            # Nothing in common (the last turn ends with eos instead): the marker that closes earlier turns.
            run = trimmed(run[:common]) or trimmed(following)[:1]
        run = trimmed(run)
        if not run:
            raise InputError("cannot find the template's end-of-turn marker after an assistant message")
        turn_end = tokenizer.decode([i for i, _, _ in run])
        texts = {"turn_end": turn_end}
        markers = {"turn_end": [i for i, _, _ in run]}

        # A role's header: between the end of the previous turn and the role's sentinel, as it sits
        # inside a conversation (so not the last turn's extras), tokenized in context.
        def header(text, previous_end, sentinel_at, role):
            region = text[previous_end:sentinel_at]
            offset = previous_end + (region.index(turn_end) + len(turn_end) if turn_end in region else 0)
            stripped = text[offset:sentinel_at].lstrip()
            if stripped.strip():
                start = sentinel_at - len(stripped)
                texts[role] = stripped
                markers[role] = [i for i, _, _ in tokens(text, start, sentinel_at)]

        source_text = text_uau or text_ua
        user_at = source_text.index(s["user"])
        header(source_text, user_at + len(s["user"]), source_text.index(s["assistant"]), "assistant")
        if "assistant" not in markers:
            prompt_only, _ = render("user")
            with_prompt, _ = render("user", prompt=True)
            if prompt_only and with_prompt and with_prompt.startswith(prompt_only) and with_prompt != prompt_only:
                header(with_prompt, len(prompt_only), len(with_prompt), "assistant")
        if "assistant" not in markers or not markers["assistant"]:
            raise InputError("cannot find the template's assistant header")
        if text_uau:
            second_user = text_uau.rindex(s["user"])
            header(text_uau, text_uau.index(s["assistant"]) + len(s["assistant"]), second_user, "user")
        # What the template inserts before the last turn's content only (an empty thinking block).
        before = text_ua[:a_start]
        header_at = before.rfind(texts["assistant"])
        prefix = (header_at + len(texts["assistant"]), a_start) if header_at >= 0 else None
        assistant_prefix = (
            [i for i, _, _ in tokens(text_ua, *prefix)] if prefix and text_ua[prefix[0] : prefix[1]].strip() else []
        )
        text_sua, _ = render("system", "user", "assistant")
        if text_sua and s["system"] in text_sua and "user" in texts:
            system_at = text_sua.index(s["system"])
            user_header_at = text_ua.rfind(texts["user"], 0, text_ua.index(s["user"]))
            preamble = text_ua[:user_header_at] if user_header_at >= 0 else ""
            if text_sua.startswith(preamble) and text_sua[len(preamble) : system_at].strip():
                header(text_sua, len(preamble), system_at, "system")
        headers = {role: markers[role] for role in ("system", "user", "assistant") if markers.get(role)}
        bos = getattr(tokenizer, "bos_token", None)
        return cls(
            headers=headers,
            turn_end=markers["turn_end"],
            texts=texts,
            assistant_prefix=assistant_prefix,
            blank_ids=blank,
            eos_id=tokenizer.eos_token_id,
            starts_with_bos=bool(bos) and text_ua.startswith(str(bos)),
        )


BYTE_FALLBACK_BLANKS = {"<0x0A>", "<0x09>", "<0x20>"}


def _blank_ids(tokenizer: Any) -> np.ndarray:
    """[vocab] bool: tokens that decode to whitespace only (tolerated next to turn markers)."""
    vocab = tokenizer.get_vocab()
    blank = np.zeros(max(len(tokenizer), max(vocab.values(), default=0) + 1), dtype=bool)
    # Whitespace characters as byte-level (Ġ Ċ ĉ) and SentencePiece (▁) vocabularies spell them, and
    # SentencePiece's byte-fallback pieces for them: a strip() set of "<0x0A>" would also blank "A", "0", "x".
    pieces = [t for t in vocab if t in BYTE_FALLBACK_BLANKS or t.strip("\u0120\u010a\u0109\u2581\n\t\r ") == ""]
    for token in pieces:
        # A lone word-start piece decodes to nothing (a legacy SentencePiece `▁` after a special token).
        text = tokenizer.convert_tokens_to_string([token])
        if text.isspace() or not text:
            blank[vocab[token]] = True
    return blank


def matches(ids: np.ndarray, seq: list[int]) -> np.ndarray:
    """[N, T] bool: the sequence `seq` starts at each position."""
    n, t = ids.shape
    out = np.zeros((n, t), dtype=bool)
    k = len(seq)
    if k == 0 or k > t:
        return out
    hit = np.ones((n, t - k + 1), dtype=bool)
    for j, token in enumerate(seq):
        hit &= ids[:, j : t - k + 1 + j] == token
    out[:, : t - k + 1] = hit
    return out


def _shift(mask: np.ndarray, by: int) -> np.ndarray:
    """Move True marks `by` positions to the right (marks past the end drop)."""
    out = np.zeros_like(mask)
    if by < mask.shape[1]:
        out[:, by:] = mask[:, : mask.shape[1] - by]
    return out


def _covered(starts: np.ndarray, length: int) -> np.ndarray:
    """Every position of a `length`-token run starting at `starts`."""
    out = np.zeros_like(starts)
    for j in range(length):
        out |= _shift(starts, j)
    return out


def expected_labels(
    ids: np.ndarray, attention: np.ndarray, layout: TemplateLayout, pad_id: int | None, last_turn_only: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Expected category (MASKED / TRAINED / PADDING / EITHER) of every position of right-aligned rows.

    Trained: from the end of each assistant header through the next end-of-turn marker
    (or the row's end when truncated); with `last_turn_only`, the last assistant turn of each
    row only. Padding: attention 0, and the runs of pad ids before the first / after the
    last real token that are not an open assistant turn's end marker (so pad == eos is
    handled). EITHER (collators differ, all fine): whitespace tokens right after an
    end-of-turn marker, the template's eos after the last turn, and what the
    template inserts before the content (`assistant_prefix`, e.g. an empty thinking block).
    Also returns [N, T] marks of the assistant turns before each row's last one (trained unless
    `last_turn_only`). Rows shorter than T are filled with -1 ids and attention 0.
    """
    n, t = ids.shape
    header = layout.headers["assistant"]
    header_at = matches(ids, header)
    opens = _shift(header_at, len(header))
    end_at = matches(ids, layout.turn_end)
    closes = _shift(end_at, len(layout.turn_end))
    events = np.full((n, t), -1, dtype=np.int8)
    events[closes] = MASKED
    events[opens] = TRAINED
    positions = np.where(events >= 0, np.arange(t), 0)
    np.maximum.accumulate(positions, axis=1, out=positions)
    state = np.take_along_axis(events, positions, axis=1)
    state = np.where(state == TRAINED, TRAINED, MASKED).astype(np.int8)
    turn = np.cumsum(opens, axis=1)
    earlier = (turn < turn[:, -1:]) & (state == TRAINED)
    if last_turn_only:
        state[earlier] = MASKED

    either = np.zeros((n, t), dtype=bool)
    blank = layout.blank_ids[np.clip(ids, 0, len(layout.blank_ids) - 1)] & (ids >= 0) & (ids < len(layout.blank_ids))
    if layout.assistant_prefix:
        prefix_at = matches(ids, layout.assistant_prefix) & opens
        either |= _covered(prefix_at, len(layout.assistant_prefix))
    edge = closes | _shift(either, 1)
    for _ in range(3):  # a short run of whitespace tokens after the end-of-turn marker or the prefix
        edge_blank = edge & blank
        either |= edge_blank
        edge = _shift(edge_blank, 1)
    if layout.eos_id is not None and layout.eos_id not in layout.turn_end:
        last = np.maximum((attention != 0).sum(1) - 1, 0)
        at_last = np.zeros((n, t), dtype=bool)
        at_last[np.arange(n), last] = True
        either |= at_last & (ids == layout.eos_id) & (state == MASKED)

    padding = attention == 0
    if pad_id is not None:
        is_pad = ids == pad_id
        trailing = np.flip(np.cumprod(np.flip(is_pad | (ids < 0), axis=1), axis=1), axis=1).astype(bool)
        leading = np.cumprod(is_pad, axis=1).astype(bool)
        padding |= (trailing & is_pad & (state == MASKED)) | leading
    # The template's own final eos is attended text even when the pad id is the same token.
    expected = np.where(either & (attention != 0), EITHER, np.where(padding, PADDING, state)).astype(np.int8)
    return expected, earlier & (expected != PADDING) & (expected != EITHER)


def empty_turns(ids: np.ndarray, layout: TemplateLayout) -> dict[str, np.ndarray]:
    """Per role, [N, T] marks of empty turns: the role's header followed (whitespace aside) directly
    by the end-of-turn marker."""
    end_at = matches(ids, layout.turn_end)
    blank = layout.blank_ids[np.clip(ids, 0, len(layout.blank_ids) - 1)] & (ids >= 0) & (ids < len(layout.blank_ids))
    empty = {}
    for role, seq in layout.headers.items():
        reach = _shift(matches(ids, seq), len(seq))
        for _ in range(3):
            reach |= _shift(reach & blank, 1)
        empty[role] = reach & end_at
    return empty


def actual_labels(labels: np.ndarray, attention: np.ndarray) -> np.ndarray:
    trained = labels != IGNORE_INDEX
    return np.where(trained, TRAINED, np.where(attention == 0, PADDING, MASKED)).astype(np.int8)


def to_matrix(column: Any, fill: int) -> np.ndarray:
    """A polars list column (ragged rows) -> [N, T] int64, right-filled with `fill`."""
    lengths = column.list.len().fill_null(0).to_numpy().astype(np.int64)
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(lengths), width), fill, dtype=np.int64)
    if width:
        out[np.arange(width) < lengths[:, None]] = column.explode().drop_nulls().to_numpy()
    return out


def sample_blocks(frame: Any, rows: int = 8192):
    """(part, input_ids, labels, attention) per block of recorded rows, as [N, T] matrices."""
    for offset in range(0, frame.height, rows):
        part = frame.slice(offset, rows)
        yield (
            part,
            to_matrix(part["input_ids"], -1),
            to_matrix(part["labels"], IGNORE_INDEX),
            to_matrix(part["attention_mask"], 0),
        )


# --------------------------------------------------------------------------- tokenizer


_LOADED: dict[tuple[str, float], Any] = {}  # (folder, newest file time) -> tokenizer, the last few


def _key(path: Path) -> tuple[str, float]:
    files = [p for p in path.glob("*") if p.is_file()] if path.is_dir() else []
    if not files:
        raise InputError(f"{path}: no saved tokenizer")
    return str(path.resolve()), max(p.stat().st_mtime for p in files)


class TokenizerUnusable(InputError):
    """A saved tokenizer sftaudit will not load (it asks for remote code, or cannot be built whole)."""


def load_tokenizer(path: str | Path) -> Any:
    """A saved tokenizer (transformers, without torch), cached while its files are unchanged. Never code
    from the folder (`trust_remote_code=False`, no prompt), never one rebuilt from part of its files:
    those raise TokenizerUnusable with the reason."""
    key = _key(Path(path))
    if key not in _LOADED:
        try:
            tokenizer = load_saved_tokenizer(key[0])
        except TokenizerRefused as exc:
            raise TokenizerUnusable(f"{path}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any loader failure is bad input
            raise InputError(f"{path}: cannot load tokenizer: {type(exc).__name__}: {one_line(exc)}") from None
        remember_tokenizer(path, tokenizer)
    return _LOADED[key]


def remember_tokenizer(path: str | Path, tokenizer: Any) -> None:
    """`tokenizer` is what is saved in `path` (preflight just saved it): the checks reuse it, not a reload."""
    while len(_LOADED) >= 4:
        _LOADED.pop(next(iter(_LOADED)))
    _LOADED[_key(Path(path))] = tokenizer


# --------------------------------------------------------------------------- layouts


@functools.lru_cache(maxsize=8)
def _layout(tokenizer: Any, source: str) -> TemplateLayout:
    return TemplateLayout.derive(tokenizer, source)


def run_layout(tokenizer: Any) -> TemplateLayout | None:
    source = template_source(getattr(tokenizer, "chat_template", None))
    return _layout(tokenizer, source) if source else None
