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
    commands = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices)
    for command in commands.choices:
        assert f"scaletrain {command}" in cli, command
    api = (site / "reference" / "python-api" / "index.html").read_text()
    for documented in ("scaletrain.run", "scaletrain.task.Task", "with_overrides"):
        assert documented in api, documented
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
