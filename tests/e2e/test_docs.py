"""The docs site: it builds strictly (a broken link, a missing anchor or a Python reference
that does not resolve fails the build), its generated reference names every flag and every
configuration key, and the README stays a front page."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO, headless_chromium, needs_browser


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """The site, built with --strict (as `make docs` does) once for the tests below."""
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return site


def test_the_site_builds_strictly_with_every_flag_and_key(site):
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
    # Every message a run can stop with, read from the source: a refusal of the modes'
    # checks, a config error and a failure that says what to do.
    errors = (site / "reference" / "errors" / "index.html").read_text()
    for message in ("pass --replica-size R", "valid top-level keys", "the previous checkpoint"):
        assert message in errors, message
    assert int(re.search(r"(\d+) messages", errors).group(1)) >= 150


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


def runnable_blocks() -> list[tuple[str, list[list[str]]]]:
    """The shell blocks the tutorials mark ``<!-- runnable -->`` (on the line before the
    fence), in the site's order: (page, its command lines as argv). ``<!-- runnable:
    FLAGS -->`` appends FLAGS to each ``scaletrain run`` of the block: the short version the
    page's numbers do not need (fewer epochs)."""
    import shlex

    nav = (REPO / "mkdocs.yml").read_text()
    pages = re.findall(r"^\s+- [^:]+: (tutorials/[\w-]+\.md)$", nav, re.M)
    out = []
    for page in pages:
        text = (REPO / "docs" / page).read_text()
        for flags, block in re.findall(r"<!-- runnable:?(.*?)-->\n```bash\n(.*?)```", text, re.S):
            lines = re.sub(r"\\\n\s*", " ", block).splitlines()
            commands = []
            for line in filter(None, (line.strip() for line in lines)):
                argv = shlex.split(line)
                assert argv[0] == "scaletrain", f"{page}: a runnable block runs scaletrain only"
                if argv[1] == "run":
                    argv += shlex.split(flags)
                commands.append(argv[1:])
            out.append((page, commands))
    return out


def test_the_tutorials_take_a_newcomer_from_two_workers_to_a_recovery_and_64_gpus(tmp_path):
    """The tutorials' runnable blocks, run in order as a reader would (in an empty directory,
    each exit status checked): a 2-worker run, a worker SIGKILLed and recovered, and a
    prediction for 64 GPUs from a calibration run."""
    blocks = runnable_blocks()
    flat = [" ".join(argv) for _, commands in blocks for argv in commands]
    assert any("--nproc-per-node 2" in c and "--inject" not in c for c in flat), flat
    assert any("--inject kill:" in c for c in flat), flat
    assert any(c.startswith("predict") and "64" in c for c in flat), flat
    for page, commands in blocks:
        for argv in commands:
            result = subprocess.run([sys.executable, "-m", "scaletrain", *argv], cwd=tmp_path,
                                    capture_output=True, text=True, timeout=300)  # fmt: skip
            assert result.returncode == 0, (
                f"{page}: scaletrain {' '.join(argv)}\n" + (result.stderr[-3000:])
            )
    import json

    summary = json.loads((tmp_path / "runs" / "restart" / "summary.json").read_text())
    assert [r["kind"] for r in summary["recoveries"]] == ["restart"]
    # The reference of the run directory names every key these runs wrote.
    documented = (REPO / "docs" / "reference" / "run-directory.md").read_text()
    for run in ("two", "restart", "calib"):
        out = tmp_path / "runs" / run
        keys = set(json.loads((out / "summary.json").read_text()))
        for line in (out / "metrics.jsonl").read_text().splitlines():
            keys |= set(json.loads(line))
        assert [k for k in sorted(keys) if f"`{k}`" not in documented] == [], run


def test_every_python_block_in_the_docs_compiles():
    blocks = [
        (page, block)
        for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    ]
    assert len(blocks) >= 4
    for page, block in blocks:
        compile(block, str(page), "exec")


@needs_browser
def test_every_page_of_the_site_in_headless_chromium(site):
    """As a reader sees it, served over HTTP on loopback (the search index is fetched): every
    page loads with no error in the browser's console and every image on it shows, and the
    search box finds a flag by its name."""
    import functools
    import http.server
    import threading

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with headless_chromium() as driver:
            pages = sorted(p.relative_to(site).parent.as_posix() for p in site.rglob("index.html"))
            assert len(pages) >= 30, pages
            images = 0
            for page in pages:
                driver.get(f"{base}/{'' if page == '.' else page + '/'}")
                shown = driver.execute_script(
                    "return Array.from(document.images)"
                    ".map(i => [i.src, i.complete, i.naturalWidth])"
                )
                for src, complete, width in shown:
                    assert complete and width > 0, (page, src)
                images += len(shown)
                errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
                assert errors == [], (page, errors)
            assert images >= 1  # the report's picture on the home page
            driver.get(f"{base}/")
            driver.find_element(By.CSS_SELECTOR, "label[for='__search']").click()
            box = driver.find_element(By.CSS_SELECTOR, "input[data-md-component='search-query']")
            box.send_keys("checkpoint-every")
            WebDriverWait(driver, 30).until(
                lambda d: "reference/cli" in d.execute_script(
                    "return Array.from(document.querySelectorAll('.md-search-result__link'))"
                    ".map(a => a.href).join(' ')"
                )
            )  # fmt: skip
            assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        server.shutdown()
