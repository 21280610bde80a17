"""The config's own documentation: each field's docstring, read from schema.py's source, and the
listing `covey train --help-config` prints."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from covey.config.schema import Config, is_group

GPU_ONLY = ("model.fused_kernels", "model.load_in_4bit", "optim.name=paged_adamw_8bit", "optim.offload",
            "rollout.engine=vllm", "rollout.decode=graphs", "rollout.decode=compile", "train.device=cuda",
            "train.gpu_memory_gib")
"""Options (a key, or a key=value) that only a GPU runs. Until docs/results.md's table "Options that only a
GPU runs" records a run on a named card and date, the option's help line says "not yet run on a GPU"
(tests/config/test_gpu_options.py ties the two together)."""


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
    """Every key with its type, default and docstring (`covey train --help-config`); a nested group of
    options under its owner, headed by what it is for."""
    lines, cfg = [], Config()
    for section in dataclasses.fields(cfg):
        lines.append(f"[{section.name}]")
        lines += describe_fields(getattr(cfg, section.name), section.name, "  ")
    return "\n".join(lines)


def describe_fields(obj, prefix: str, indent: str) -> list[str]:
    lines, docs = [], field_docs(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if is_group(value):
            lines.append(f"{indent}{key}.*: {' '.join((type(value).__doc__ or '').split())}")
            lines += describe_fields(value, key, indent + "  ")
        else:
            lines.append(f"{indent}{key} ({f.type}, default {value!r}): {docs.get(f.name, '')}")
    return lines
