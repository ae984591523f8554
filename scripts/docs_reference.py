"""The docs site's generated pages (a MkDocs hook, named in mkdocs.yml): the home page from
README.md, the command line from scaletrain's own argparse parsers, and every configuration
key from the config dataclasses. Generated at each build, so none can drift from its source.

    python scripts/docs_reference.py cli|config|environment|exit-codes|errors    prints a page
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


# The modes column of the configuration page: each key set to the values below (its type's
# own for the others: a bool flipped, a number above its default), in a small run of each
# mode, through every pre-start check (describe_plan, what `scaletrain run --dry-run` runs);
# a check that names the key refuses it there. Keys that choose the mode itself, where to
# listen or which files to read are left out (their values depend on the machine).
MODES: dict[str, dict[str, Any]] = {
    "restart": {},
    "in place": {"recovery": "inplace"},
    "ps": {"strategy": "ps", "nproc_per_node": 3, "num_servers": 1},
}
PROBE_BASE: dict[str, Any] = {"nproc_per_node": 2, "num_samples": 96, "model": "mlp",
                              "width": 8, "batch_size": 8}  # fmt: skip
PROBES: dict[str, list[Any]] = {
    "precision": ["bf16-mixed", "fp16-mixed"],
    "balance": ["speed"],
    "optimizer": ["adamw"],
    "lr_schedule": ["cosine"],
    "checkpoint_every": ["5", "auto"],
    "inject": [
        "kill:rank=1:step=3",
        "hang:rank=1:step=3",
        "slow:rank=1:factor=2",
        "corrupt-checkpoint:step=4",
    ],
    "compression": ["fp16", "bf16", "powersgd:rank=2", "topk:ratio=0.1", "sign"],
    "nnodes": ["1:2"],
    "consistency": ["asp"],
    "staleness_rule": ["share"],
    "max_memory_per_rank": [10**10],
}
# What a probe needs beside it to be a run the checks could accept.
PROBE_WITH: dict[str, dict[str, Any]] = {
    "nnodes": {"rdzv_endpoint": "127.0.0.1:29400"},
    "activation_checkpointing": {"model": "transformer"},
    "replica_size": {"strategy": "fsdp"},  # where the mode does not fix the strategy
    "ps_replicas": {"num_servers": 2, "nproc_per_node": 4},  # a backup is another server
}
UNPROBED = {"out", "strategy", "recovery", "rdzv_endpoint", "rdzv_id", "local_addr", "bind",
            "join_token_file", "device", "dataset", "data_dir", "task", "model", "schedule",
            "split_points", "nproc_per_node", "node_rank", "num_servers", "tp", "stages",
            "staleness"}  # fmt: skip


def probe_values(name: str, f: Any) -> list[Any]:
    if name in PROBES:
        return PROBES[name]
    if name in UNPROBED or f.type == "str":
        return []
    if f.type == "bool":
        return [not f.default]
    if f.type == "int":
        return [f.default + 1 if f.default >= 1 else 2]
    if 0 < f.default < 1:
        return [f.default / 2]
    return [f.default * 2 if f.default else 1.0]


def mode_cell(name: str, values: list[Any], base: dict[str, Any]) -> str:
    """What the pre-start checks say of ``name`` at each of ``values`` in the mode of
    ``base``: "yes", or the values refused and why."""
    from scaletrain.config import RunConfig, with_overrides
    from scaletrain.launch import describe_plan

    refused = []
    for value in values:
        extra = {"mtbf_s": 60.0} if value == "auto" else PROBE_WITH.get(name, {})
        try:
            describe_plan(with_overrides(RunConfig(), {**PROBE_BASE, **extra, **base,
                                                       name: value}))  # fmt: skip
        except ValueError as e:
            reasons = [part.partition(": ")[2] for part in str(e).split("; ")
                       if part.startswith(f"{name}: ")]  # fmt: skip
            if not reasons:  # refused for something else: the probe is wrong, not the key
                raise RuntimeError(f"the probe {name}={value!r} over {base} was refused for "
                                   f"another reason: {e}") from None  # fmt: skip
            what = f"`{value}` " if len(values) > 1 else ""
            refused.append(f"{what}refused: {reasons[0]}")
    return "; ".join(refused) or "yes"


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
    out.append(
        "## Which mode refuses what\n\n"
        "Each key below set (to the values named where it has several) in a small run of "
        "each mode (`restart`, the default; `in place`, `--recovery inplace`; `ps`, "
        "`--strategy ps`), through every pre-start check: *yes* where no check refuses it, "
        "else the check's reason. Generated by running the checks at each build. A *yes* "
        "says the mode accepts the key, not that every strategy uses it (a key's help names "
        "the strategies it is for).\n"
    )
    out.append("| key | restart | in place | ps |\n|---|---|---|---|")
    for name, (_, f) in fields.items():
        values = probe_values(name, f)
        if values:
            cells = [_cell(mode_cell(name, values, base)) for base in MODES.values()]
            out.append(f"| `{name}` | " + " | ".join(cells) + " |")
    out.append("")
    return "\n".join(out)


def environment_page() -> str:
    """Every environment variable, from scaletrain/env.py (its constants, their comments, and
    the comment lines that head each group)."""
    import re

    import scaletrain.env as env

    out = [
        "# Environment variables\n",
        "Every environment variable scaletrain reads or sets, generated from "
        "`scaletrain/env.py`, where each is named once. The launcher sets most of them for "
        "the processes it starts; the ones a user gives are marked so.\n",
    ]
    rows: list[str] = []
    for line in Path(env.__file__).read_text().splitlines():
        heading = re.match(r"^# (.+)$", line)
        if heading:
            if rows:
                out.append("| variable | what it is |\n|---|---|\n" + "\n".join(rows) + "\n")
                rows = []
            out.append(f"## {heading.group(1).rstrip('.:')}\n")
            continue
        const = re.match(r'^([A-Z_]+) = "([A-Z_]+)"(?:\s*# (.*))?$', line)
        if const:
            rows.append(f"| `{const.group(2)}` | {_cell(const.group(3) or '')} |")
    if rows:
        out.append("| variable | what it is |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


def exit_codes_page() -> str:
    """The exit statuses, their numbers read from the code."""
    from scaletrain.fault.preempt import PREEMPTED_EXIT_CODE
    from scaletrain.fault.watchdog import HANG_EXIT_CODE
    from scaletrain.launch.rendezvous import UNREACHABLE_EXIT_CODE

    codes = [
        ("0", "the job finished (also after recoveries)."),
        (
            "1",
            "the job failed: a worker failed for good (its log's last lines follow the "
            "message), the launch failed, or an internal failure (it says so: a bug to "
            "report, never the user's input).",
        ),
        (
            "2",
            "`scaletrain: error: ...`: the user's mistake only (a flag, a value, a "
            "combination a mode would not honour, a run directory that holds another "
            "job); nothing was started.",
        ),
        (
            str(PREEMPTED_EXIT_CODE),
            "preempted (SIGTERM, or SIGUSR1 as SLURM's --signal "
            "sends): checkpointed where the mode can, and stopped; the same command "
            "continues the job.",
        ),
        ("130", "interrupted (Ctrl-C); the workers were stopped."),
    ]
    worker = [
        (
            str(HANG_EXIT_CODE),
            "ended by its own watchdog after `--hang-timeout-s` without "
            "progress (restarted, or the job fails, as after a death).",
        ),
        (str(UNREACHABLE_EXIT_CODE), "could not reach the rendezvous (a node cut off)."),
    ]
    table = "| status | meaning |\n|---|---|\n"
    return "\n".join([
        "# Exit codes\n",
        "What `scaletrain run` (and `demo`) exit with; the numbers are read from the code.\n",
        table + "\n".join(f"| {c} | {t} |" for c, t in codes) + "\n",
        "## A worker process's own\n",
        "Recorded in `logs/incidents.jsonl` and summary.json's `recoveries`, not the "
        "command's exit status:\n",
        table + "\n".join(f"| {c} | {t} |" for c, t in worker) + "\n",
    ])  # fmt: skip


# The exceptions whose message stops a run: input refused (ValueError), and failures that
# say what to do.
STOPPING = ("ValueError", "CheckpointError", "StateLost", "LaunchFailed", "PSFailed",
            "WorkerFailed")  # fmt: skip


def message_text(node: Any) -> str | None:
    """The text of a message expression: literal parts kept, each value as "…"; None when
    the message is not built from literals (a variable passed on)."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message_text(node.left), message_text(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "join":
        return "…"
    return None


def stopping_messages() -> list[tuple[str, str]]:
    """(module, message) of every message scaletrain can stop a run with:
    every literal message raised as one of STOPPING, and every refusal of the modes' pre-start
    checks (launch/modes.py appends them to a list). Read from the source with ``ast``."""
    import ast

    root = Path(__file__).resolve().parents[1] / "src"
    out = []
    for path in sorted((root / "scaletrain").rglob("*.py")):
        module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
        for node in ast.walk(ast.parse(path.read_text())):
            call = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                call = node.exc if name in STOPPING else None
            elif (module == "scaletrain.launch.modes" and isinstance(node, ast.Call)
                  and getattr(node.func, "attr", "") == "append"):  # fmt: skip
                call = node
            if call is None or not call.args:
                continue
            text = message_text(call.args[0])
            if text and not text.startswith("internal failure"):
                out.append((module, " ".join(text.split())))
    return out


def markdown_escaped(text: str) -> str:
    """``text`` shown as written: Markdown's emphasis, code and link marks escaped."""
    for mark in "\\`*_[]":
        text = text.replace(mark, "\\" + mark)
    return text.replace("<", "&lt;")


def errors_page() -> str:
    rows = stopping_messages()
    lines = [
        "# Error messages\n",
        "Every message scaletrain can stop a run with, generated from the source (each "
        "literal message raised as a refusal or a failure, and every refusal of the modes' "
        "pre-start checks): the text as the code writes it, `…` where it puts a value (a "
        "flag's value, a path, a count). A message names the flag or key at fault first "
        "(`nnodes: …`), and says what to do instead. Input refused before anything starts "
        "prints `scaletrain: error: …` and exits 2; a failure after the start exits 1 "
        "([exit codes](exit-codes.md)). "
        "[Troubleshooting](../guides/troubleshooting.md) explains the failures that need "
        "more than a message. Messages that begin with `internal failure:` are bugs to "
        "report, never your input, and are not listed.\n",
        f"{len(rows)} messages.\n",
    ]
    for module in dict.fromkeys(m for m, _ in rows):
        lines.append(f"## {module}\n")
        lines += [f"- {markdown_escaped(text)}" for m, text in rows if m == module]
        lines.append("")
    return "\n".join(lines)


def home_page() -> str:
    """The site's home: README.md, its links made relative to docs/ (one text, two places)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return readme.replace("](docs/", "](")


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the build."""
    from mkdocs.structure.files import File

    pages = {"index.md": home_page, "reference/cli.md": cli_page,
             "reference/config.md": config_page, "reference/environment.md": environment_page,
             "reference/exit-codes.md": exit_codes_page,
             "reference/errors.md": errors_page}  # fmt: skip
    for path, page in pages.items():
        files.append(File.generated(config, path, content=page()))
    return files


if __name__ == "__main__":
    pages = {"cli": cli_page, "config": config_page, "environment": environment_page,
             "exit-codes": exit_codes_page, "errors": errors_page}  # fmt: skip
    sys.stdout.write(pages[sys.argv[1]]())
