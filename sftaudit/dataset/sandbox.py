"""The chat template's sandbox: jinja2's AST as transformers compiles it, and every render bounded in characters, steps and seconds (a hostile template is refused, never run unbounded). No torch."""

from __future__ import annotations

import functools
import re
import threading
import time
import types
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
import jinja2.sandbox

from ..errors import InputError, one_line
from .template_text import TemplateOverBudget


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


def compiled_template(source: str) -> jinja2.Template | None:
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
    except RecursionError:  # jinja's parser recurses once per nested expression: ((((... thousands deep
        raise InputError("chat template does not parse: nested too deeply") from None


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


def render_budgeted(template: jinja2.Template, blocks: list[str] | None = None, **context: Any) -> str:
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


def parse_template(source: str) -> nodes.Template:
    template = compiled_template(source)
    return (template.environment if template is not None else _PARSE_ENVIRONMENT).parse(source)
