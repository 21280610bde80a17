"""The config's own documentation: each field's docstring, read from schema.py's source, and the
listing `covey train --help-config` prints."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from covey.config.schema import Config


def field_docs(section_class) -> dict[str, str]:
    """{field: its one-line docstring} of a config section, read from the source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(section_class))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe_keys() -> str:
    """Every key with its type, default and docstring (`covey train --help-config`)."""
    lines, cfg = [], Config()
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        docs = field_docs(type(obj))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(obj):
            lines.append(f"  {section.name}.{f.name} ({f.type}, default {getattr(obj, f.name)!r}): "
                         f"{docs.get(f.name, '')}")
    return "\n".join(lines)

