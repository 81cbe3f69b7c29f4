"""mkdocs hook: the reference pages that must not drift from the code, generated at build time.

- ``reference/cli.md`` gets every command and option, read from the Typer application itself
  (the click command tree ``meshtrain --help`` prints from).
- ``reference/settings.md`` gets every setting, read from its one typed definition
  (the dataclasses of ``meshtrain/config/``: their fields, types, defaults, limits, help, flags).
- ``contributing.md`` is ``CONTRIBUTING.md`` from the repository root, so the site and the file a
  contributor opens first are one text.

The hand-written text of each page stays; the generated part is appended to it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import typer
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]

#: The settings, one table per definition: (heading, the module and class, what it covers).
SETTINGS_CLASSES = (
    ("Run settings", "meshtrain.config.spec", "RunSpec",
     "`simulate`, `launch` and `compare` (flags), profiles, `--set` and `Trainer.fit`"),
    ("Launch options", "meshtrain.config.launching", "LaunchSettings", "`meshtrain launch`"),
    ("hosts setup", "meshtrain.config.hosts", "HostsSetupSettings", "`meshtrain hosts setup`"),
    ("hosts check", "meshtrain.config.hosts", "HostsCheckSettings", "`meshtrain hosts check`"),
    ("hosts bench", "meshtrain.config.hosts", "HostsBenchSettings", "`meshtrain hosts bench`"),
    ("hosts discover", "meshtrain.config.hosts", "HostsDiscoverSettings", "`meshtrain hosts discover`"),
    ("up", "meshtrain.config.hosts", "UpSettings", "`meshtrain up`"),
    ("plan", "meshtrain.config.plan", "PlanSettings", "`meshtrain plan`"),
    ("compare", "meshtrain.config.research", "CompareSettings", "`meshtrain compare`"),
    ("plot", "meshtrain.config.research", "PlotSettings", "`meshtrain plot`"),
    ("dashboard", "meshtrain.config.dashboard", "DashboardSettings", "`meshtrain dashboard`"),
    ("transcribe", "meshtrain.config.transcribe", "TranscribeSettings", "`meshtrain transcribe`"),
)


def cell(text: object) -> str:
    """``text`` safe inside one Markdown table cell: one line, pipes escaped, rich's markup
    escapes undone, angle brackets as entities (``<out>`` is not an HTML tag)."""
    one_line = " ".join(str(text).split()).replace("\\[", "[")
    return one_line.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: str) -> str:
    """``text`` as inline code, whatever backticks it holds."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def command_help(text: str) -> list[str]:
    """A command's docstring as Markdown: paragraphs as they are, the indented example lines
    (Typer's ``Examples:`` block) as one shell code block."""
    out: list[str] = []
    examples: list[str] = []
    for line in text.replace("\b", "").splitlines():
        if line.startswith("  ") and line.strip():
            examples.append(line.strip())
            continue
        if examples and not line.strip():
            continue
        if examples:
            out += ["", "```bash", *examples, "```", ""]
            examples = []
        out.append(line.replace("\\[", "["))
    if examples:
        out += ["", "```bash", *examples, "```"]
    return out


def _option_rows(command: Any, ctx: Any) -> dict[str, list[str]]:
    panels: dict[str, list[str]] = {}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            name = (param.metavar or param.name or "").upper()
            required = "required" if param.required else "optional"
            help_text = cell(getattr(param, "help", "") or "")
            panel, row = "Arguments", f"| {code(name)} | {help_text} ({required}) |"
        else:
            record = param.get_help_record(ctx)
            if record is None:
                continue
            names, help_text = record
            panel = getattr(param, "rich_help_panel", None) or "Options"
            row = f"| {code(names)} | {cell(help_text)} |"
        panels.setdefault(panel, []).append(row)
    return panels


def command_markdown(command: Any, path: list[str], parent: Any) -> list[str]:
    """The section of one command (and, for a group, of each of its commands). Typer carries
    its own copy of click, so commands are recognised by what they do, not by click's classes."""
    ctx = command.context_class(command, info_name=path[-1], parent=parent)
    title = " ".join(path)
    lines = [f"## `{title}`" if len(path) > 1 else f"## `{title}` (the application)", ""]
    lines += command_help(command.help or "") + [""]
    usage = " ".join([title, *command.collect_usage_pieces(ctx)])
    lines += ["```text", f"Usage: {usage}", "```", ""]
    for panel, rows in _option_rows(command, ctx).items():
        lines += [f"**{panel}**", "", "| option | what it does |", "|---|---|", *rows, ""]
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                lines += command_markdown(sub, [*path, name], ctx)
    return lines


def cli_reference() -> str:
    """Every command of ``meshtrain`` and every option, from the application itself."""
    from meshtrain.cli.main import app

    root = typer.main.get_command(app)
    lines = ["", "Options that set a run setting take their default and limits from "
             "[Settings](settings.md).", ""]
    return "\n".join(lines + command_markdown(root, ["meshtrain"], None)) + "\n"


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    elif f.default is dataclasses.MISSING:
        return "(required)"
    else:
        value = f.default
    return code(repr(value))


def _number(value: float) -> str:
    """A limit as written in its definition: a whole number whole (2**63 - 1, not 9.22337e+18)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _limits(meta: dict[str, Any]) -> str:
    parts = []
    if meta.get("minimum") is not None:
        parts.append(f">= {_number(meta['minimum'])}")
    if meta.get("above") is not None:
        parts.append(f"> {_number(meta['above'])}")
    if meta.get("maximum") is not None:
        parts.append(f"<= {_number(meta['maximum'])}")
    if meta.get("choices"):
        parts.append("one of " + ", ".join(code(c) for c in meta["choices"]))
    if meta.get("on_resume"):  # a run setting: what a resumed run may do with it
        parts.append(f"on resume: {meta['on_resume']}")
    return cell("; ".join(parts)) if parts else ""


def settings_table(cls: type) -> list[str]:
    """One row per field of a settings dataclass: name, flag and its commands, type, default,
    limits, help."""
    rows = ["| setting | flag (commands) | type | default | limits | what it sets |",
            "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata)
        if "help" not in meta:
            continue
        flag = meta.get("flag")
        shown = f"{code(', '.join(flag.names))} ({', '.join(flag.commands)})" if flag else "-"
        rows.append(f"| {code(f.name)} | {shown} | {code(str(f.type))} | {_default(f)} | "
                    f"{_limits(meta)} | {cell(meta['help'])} |")
    return rows


def settings_reference() -> str:
    """Every setting, from the dataclasses that define them."""
    import importlib

    lines = [""]
    for heading, module, name, where in SETTINGS_CLASSES:
        cls = getattr(importlib.import_module(module), name)
        lines += [f"## {heading}", "", f"Taken by {where}; defined by `{module}.{name}`.", ""]
        lines += settings_table(cls) + [""]
    return "\n".join(lines)


GENERATED = {"reference/cli.md": cli_reference, "reference/settings.md": settings_reference}


def contributing() -> str:
    """CONTRIBUTING.md with its links into docs/ made relative to the site's root."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    return text.replace("](docs/", "](").replace("](README.md)", "](index.md)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "contributing.md",
                                content=contributing()))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    generate = GENERATED.get(page.file.src_uri)
    if generate is None:
        return markdown
    return markdown.rstrip() + "\n" + generate()



#: A Sphinx cross-reference role left in a docstring (``:class:`~a.b.C```), as it comes out of
#: mkdocstrings: the role's name before the code span, and the ``~`` that shortens the path.
_SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """The docstrings' Sphinx roles shown as what they name (``TrainConfig``), not as markup."""
    def shown(match: re.Match[str]) -> str:
        target = match.group(2)
        return f"<code>{target.rsplit('.', 1)[-1] if match.group(1) else target}</code>"

    return _SPHINX_ROLE.sub(shown, html)
