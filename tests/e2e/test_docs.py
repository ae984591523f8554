"""The docs site: it builds strictly (a broken link, a missing anchor or a Python reference
that does not resolve fails the build), its generated reference names every flag and every
configuration key, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_the_site_builds_strictly_with_every_flag_and_key(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    from scaletrain.cli import build_parser
    from scaletrain.config import leaf_fields

    cli = (site / "reference" / "cli" / "index.html").read_text()
    config = (site / "reference" / "config" / "index.html").read_text()
    for name in leaf_fields():
        assert f"--{name.replace('_', '-')}" in cli, name
        assert f"<code>{name}</code>" in config, name
    # The modes table comes from the pre-start checks themselves: a refusal there shows.
    modes = config[config.index('id="which-mode-refuses-what"') :]
    row = re.search(r"<code>checkpoint_async</code></td>(.*?)</tr>", modes, re.S)
    assert row and row.group(1).count("yes") == 2 and "always write" in row.group(1), row
    commands = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    for command in commands.choices:
        assert f"scaletrain {command}" in cli, command
    api = (site / "reference" / "python-api" / "index.html").read_text()
    for documented in ("scaletrain.run", "scaletrain.task.Task", "with_overrides"):
        assert documented in api, documented
    environment = (site / "reference" / "environment" / "index.html").read_text()
    import scaletrain.env as env

    for value in vars(env).values():
        if isinstance(value, str) and value.isupper():
            assert f"<code>{value}</code>" in environment, value
    home = (site / "index.html").read_text()
    assert "Setup: two commands" in home


def test_the_config_pages_example_is_a_config_that_loads(tmp_path):
    from scaletrain.config import load_toml

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from docs_reference import config_page
    finally:
        sys.path.remove(str(REPO / "scripts"))
    example = re.search(r"```toml\n(.*?)```", config_page(), re.S)
    assert example
    path = tmp_path / "run.toml"
    path.write_text(example.group(1))
    tomllib.loads(example.group(1))
    cfg = load_toml(path)
    assert (cfg.train.strategy, cfg.launch.nproc_per_node) == ("fsdp", 4)


def test_the_readme_is_a_front_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (REPO / target).is_file(), target


def documented_commands() -> list[tuple[str, list[str], str]]:
    """Every ``scaletrain`` command line in a shell block of README.md and docs/ (continued
    lines joined, shell variables set earlier on the page expanded): (page, argv, its
    comment)."""
    import shlex

    out = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text()
        variables: dict[str, str] = {}  # a page is one shell session: a variable set stays
        for block in re.findall(r"```(?:bash|sh|text)?\n(.*?)```", text, re.S):
            block = re.sub(r"\\\n\s*", " ", block)
            variables |= dict(re.findall(r'^(\w+)="([^"]*)"', block, re.M))
            for line in block.splitlines():
                line = line.strip().removeprefix("$ ")
                if not line.startswith("scaletrain ") or "..." in line:
                    continue
                command, _, comment = line.partition("#")
                for name, value in variables.items():
                    command = command.replace(f"${name}", value)
                command = re.sub(r"\[(--[\w-]+)\]", "", command)  # an optional flag shown
                out.append((page.relative_to(REPO).as_posix(), shlex.split(command)[1:], comment))
    return out


def test_every_documented_command_is_one_the_command_line_takes(tmp_path, capsys):
    """Each command the docs show parses (every flag exists); a `run` passes every pre-start
    check (`--dry-run`), or is refused with exit 2 where its comment says so; `predict` and
    `plan` from a description run for real. A flag renamed or a combination that became
    refused fails here, not in a reader's terminal."""
    from scaletrain.cli import build_parser, run_command

    commands = documented_commands()
    assert len(commands) >= 25
    parser = build_parser()
    for page, argv, comment in commands:
        where = f"{page}: scaletrain {' '.join(argv)}"
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{where} does not parse: {capsys.readouterr().err}") from e
        inputs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--data", "--task")]
        if argv[0] == "run" and all((REPO / path.split(":")[0]).exists() for path in inputs):
            # (A run of data the page made first, `scaletrain shard ...`, parses only.)
            if "--out" in argv:  # nothing is written by --dry-run; never the repo's runs/
                argv = [*argv[: argv.index("--out")], *argv[argv.index("--out") + 2 :]]
            code = run_command([*argv, "--out", str(tmp_path / "never-written"), "--dry-run"])
            expected = 2 if "refused" in comment else 0
            assert code == expected, f"{where}: exit {code}: {capsys.readouterr().err}"
        elif argv[0] in ("predict", "plan") and "--calibrate" not in argv:
            assert run_command(argv) == 0, f"{where}: {capsys.readouterr().err}"
        capsys.readouterr()
