"""What a chat template reads: every field of a message and of its context, walking jinja2's own AST (message aliases followed through ``for``/``set``), and its literal strings."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import jinja2
import jinja2.meta
import jinja2.nodes as nodes

from .sandbox import parse_template

# Tests that make a field read optional: `message.tool_calls is defined`, `... is none`.
_OPTIONAL_TESTS = {"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"}
_CHAT_ROLES = {"system", "user", "assistant", "role"}


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
    ast = parse_template(source)
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
