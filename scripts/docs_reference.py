"""The docs site's generated pages (a MkDocs hook, named in mkdocs.yml): the home page from
README.md, the command line from scaletrain's own argparse parsers, and every configuration
key from the config dataclasses. Generated at each build, so none can drift from its source.

    python scripts/docs_reference.py cli|config    prints a page (what the hook adds)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def cli_page() -> str:
    from scaletrain.cli import build_parser

    parser = build_parser()
    out = [
        "# Command line\n",
        "Every `scaletrain` command and its flags, generated from the command line's own "
        "parsers (`scaletrain COMMAND --help` prints the same). The training flags of `run` "
        "and `bench` are the configuration keys: [Configuration](config.md) gives each one's "
        "TOML table, type and default.\n",
    ]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        out.append(f"## scaletrain {name}\n")
        out.append(f"{helps.get(name) or ''}\n")
        if sub.description:
            out.append(f"{sub.description}\n")
        out.append("```text\n" + sub.format_usage().strip() + "\n```\n")
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
            if isinstance(action, argparse.BooleanOptionalAction):
                flags = f"`{action.option_strings[0]}` / `{action.option_strings[1]}`"
            text = (action.help or "").replace("%%", "%")
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS, False) else f" (default {default!r})"
            rows.append(f"| {flags} | {_cell(text + ('' if 'default' in text else shown))} |")
        if rows:
            out.append("| flag | what it does |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


def config_page() -> str:
    from scaletrain.config import SECTIONS, leaf_fields

    out = [
        "# Configuration\n",
        "Every key of a run's configuration, generated from the config dataclasses "
        "(`scaletrain/config.py`). Each is a flag of `scaletrain run` (`--key-name`) and a key "
        "of a TOML file given with `--config` (in its table); a flag overrides the file. A key "
        "that a mode or strategy would not honour is refused before any process starts, with "
        "the reason: [which flags each mode honours](../guides/fault-tolerance.md#which-flags-"
        "each-mode-honours).\n",
        '```toml\n# run.toml: scaletrain run --config run.toml\n[train]\nstrategy = "fsdp"\n'
        "epochs = 3\n\n[launch]\nnproc_per_node = 4\n```\n",
    ]
    fields = leaf_fields()
    order = [None, *SECTIONS]
    for section in order:
        keys = [(n, f) for n, (s, f) in fields.items() if s == section]
        if not keys:
            continue
        doc = (SECTIONS[section].__doc__ or "").split("\n\n")[0] if section else ""
        out.append(f"## `[{section}]`\n" if section else "## Top level\n")
        if doc and not doc.startswith(SECTIONS[section].__name__ + "("):
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | flag | type | default | what it does |\n|---|---|---|---|---|")
        for name, f in keys:
            flag = "--" + name.replace("_", "-")
            out.append(f"| `{name}` | `{flag}` | {f.type} | `{f.default!r}` | "
                       f"{_cell(f.metadata.get('help', ''))} |")  # fmt: skip
        out.append("")
    return "\n".join(out)


def home_page() -> str:
    """The site's home: README.md, its links made relative to docs/ (one text, two places)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return readme.replace("](docs/", "](")


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the build."""
    from mkdocs.structure.files import File

    pages = {"index.md": home_page, "reference/cli.md": cli_page,
             "reference/config.md": config_page}  # fmt: skip
    for path, page in pages.items():
        files.append(File.generated(config, path, content=page()))
    return files


if __name__ == "__main__":
    sys.stdout.write(cli_page() if sys.argv[1:] == ["cli"] else config_page())
