"""``make stress``: run the fault tests ROUNDS times and print each test's pass count.

Every round is one pytest process over the fault tests (worker kills and hangs, damaged
checkpoints, node loss, parameter-server worker and server kills, a link's peer killed
mid-message, a node's beat to node 0 cut or orphaned, in-place recovery, whole
jobs preempted or killed and run again, a preemption signal at each moment of a run, the
multi-host lab when it can run; not the tests there that inject no fault) and the flag-space
fuzzer (new combinations checked and trained every round), with a new
SCALETRAIN_STRESS_SEED, so the bitwise-resume property test draws new configurations and
kill points each round
(SCALETRAIN_RESUME_DRAWS of them; default 3 a round here, 1 in ``make test``).

A test that fails in any round is a bug to find: the summary lists every failure with the
round's seed, which reproduces the draws (SCALETRAIN_STRESS_SEED=<seed> pytest ...), and
the round's whole pytest output is kept in runs/stress/.
Exit status: 0 when every test passed every round, 1 otherwise.

Rounds add up across invocations: every round of a clean checkout (no tracked file changed)
is appended to runs/stress/ledger.jsonl under its commit, and the summary ends with the
pass counts of every round recorded for the code being tested, so 20 rounds can be run as
8 today and 12 tomorrow on the same code. "The same code" is every tracked file but the
documentation and this runner (see NOT_UNDER_TEST): a commit that only fixes the README
keeps the rounds of its parent, one that changes a line of src/ or tests/ starts from none.
A round of a modified tree is not recorded: it tests code that no commit names.

    python scripts/stress.py [--rounds N] [--draws D] [--flag-draws F] [--seed S]
                             [--only TEST_FILE ...] [-- extra pytest args]

A round restricted with --only (the fuzzer's rounds: ``make fuzz``) is recorded with its
files, and does not count as a full round of the same code.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from scaletrain.io import append_jsonl, read_jsonl

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "runs" / "stress"  # a failing round's whole pytest output
LEDGER = LOGS / "ledger.jsonl"  # every round of a clean checkout, by commit
FAULT_TESTS = [
    "tests/dist/test_recovery.py",
    "tests/dist/test_resume_property.py",
    "tests/dist/test_param_server.py",
    "tests/dist/test_ps_server.py",
    "tests/dist/test_ps_transport.py",
    "tests/dist/test_ps_beat.py",
    "tests/dist/test_ps_jobs.py",
    "tests/dist/test_ps_replicas.py",  # backups: kills at drawn moments, ssp, and the rest
    "tests/dist/test_inplace.py",
    "tests/dist/test_inplace_jobs.py",
    "tests/dist/test_inplace_rounds.py",
    "tests/dist/test_inplace_hsdp.py",
    "tests/dist/test_failures.py",
    "tests/dist/test_jobs.py",
    "tests/dist/test_preempt_anytime.py",  # every moment under a stress seed (3 in make test)
    "tests/unit/test_flag_space.py",  # 400 new drawn combinations a round (120 fixed ones)
    "tests/dist/test_flag_space.py",  # SCALETRAIN_FLAG_DRAWS trained a round
    "tests/e2e/test_netns.py",
    "tests/e2e/test_hosts.py",  # 4 hosts x 4 workers, one powered off: stress rounds only
    # A replica stuck in place, ended by its own watchdog, restarted and healed.
    "tests/dist/test_modes.py::test_every_cell_works_or_is_refused_before_start"
    "[inject hang-inplace]",
    # A parameter-server worker stuck, ended by its own watchdog, restarted, its leases
    # dealt again.
    "tests/dist/test_modes.py::test_every_cell_works_or_is_refused_before_start[inject hang-ps]",
    # Local SGD in place: the modes matrix's runs beyond its steady group (test_modes.py's
    # STRESS_ONLY_GROUPS).
    *(
        f"tests/dist/test_modes.py::test_every_cell_works_or_is_refused_before_start[{flag}-"
        "inplace-rounds]"
        for flag in ("inject kill", "inject hang", "compile", "activation-checkpointing")
    ),
    *(
        f"tests/dist/test_modes.py::test_every_cell_works_or_is_refused_before_start[compile-{mode}]"
        for mode in ("restart", "inplace", "ps")
    ),
    # 8 in-place replicas on 4 emulated hosts through one fault of the chaos benchmark's storm.
    "tests/e2e/test_scale.py::test_eight_replicas_through_one_fault_of_the_storm",
    # No fault, but too long for make test's budget (tests/conftest.py's stress_only).
    "tests/dist/test_essentials.py::test_compile_captures_graphs_and_trains_the_same",
    "tests/dist/test_essentials.py::test_mixed_precision_reaches_fp32_accuracy[fp16-mixed]",
    "tests/dist/test_fsdp.py::test_fsdp_and_tensor_checkpoint_restart_gives_identical_weights",
    # In-place HSDP's group checkpoints: the whole job SIGKILLed (also in make test), and
    # preempted (stress only).
    "tests/dist/test_fsdp.py::"
    "test_a_killed_hsdp_in_place_job_continues_from_its_group_checkpoint_bit_identical",
    "tests/dist/test_fsdp.py::test_a_preempted_hsdp_in_place_job_leaves_by_groups_and_continues",
    "tests/dist/test_memory_cap.py::test_sharded_strategies_train_it_under_the_cap[strategy1]",
    "tests/e2e/test_report.py::test_report_shows_balance_shares_and_each_pushs_learning_rate",
    "tests/e2e/test_cli.py::test_two_nodes_rendezvous_like_torchrun",
    "tests/dist/test_probe.py",
    "tests/e2e/test_cli.py::test_deterministic_runs_give_identical_weights",
]
# Tests in those files that inject no fault: accuracy under each optimizer and consistency
# (the four async ones are a third of a round's time), equalities and input checks. They run in
# every `make test` (but Adam under ssp, which a round runs instead); a stress round repeats
# what faults and their races exercise.
NOT_FAULT_TESTS = [
    # Its Adam-under-ssp case runs in stress rounds only (make test's budget).
    "tests/dist/test_param_server.py::test_asynchronous_modes_train_with_ddps_optimizer_flags[sgd-asp]",
    "tests/dist/test_param_server.py::test_bsp_equals_synchronous_data_parallel",
    "tests/dist/test_param_server.py::test_bad_parameter_server_input_fails_before_any_process",
    "tests/dist/test_param_server.py::test_a_local_run_listens_on_loopback_only",
    "tests/dist/test_inplace.py::test_inplace_refuses_what_it_cannot_do",
    "tests/dist/test_inplace_jobs.py::test_an_in_place_job_without_checkpoints_is_not_continued",
    "tests/dist/test_jobs.py::test_a_resume_that_changes_the_math_is_refused",
    "tests/e2e/test_netns.py::test_rates_parse_and_bad_ones_are_refused",
]
# pytest -rA's short summary: "PASSED tests/...::name", "FAILED tests/...::name - reason".
# A test id may hold spaces (the fuzzer's draws are their command lines).
RESULT = re.compile(r"^(PASSED|FAILED|ERROR) (tests/\S+::.+?)(?: - .*)?$", re.M)
# Tracked files a round does not test: the documentation, this runner and its own unit test
# (which no round runs). Two commits that differ only in these run the same code.
NOT_UNDER_TEST = ("README.md", "docs/", "scripts/stress.py", "tests/unit/test_stress_ledger.py")


def git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def clean_commit(repo: Path = REPO) -> str | None:
    """HEAD's commit when no tracked file differs from it, else None."""
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", repo=repo)
        return None if dirty else git("rev-parse", "HEAD", repo=repo)
    except (OSError, subprocess.CalledProcessError):
        return None


def under_test(path: str) -> bool:
    return not any(path == p or (p.endswith("/") and path.startswith(p)) for p in NOT_UNDER_TEST)


def code_of(commit: str, repo: Path = REPO) -> str | None:
    """A digest of the files under test in that commit (path, mode and content of each), or
    None when git does not know the commit (a ledger copied from another clone)."""
    try:
        listing = git("ls-tree", "-r", "--full-tree", commit, repo=repo)
    except (OSError, subprocess.CalledProcessError):
        return None
    kept = [line for line in listing.splitlines() if under_test(line.split("\t", 1)[1])]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def rounds_of_the_same_code(records: list[dict], commit: str, repo: Path = REPO) -> list[dict]:
    """The ledger's full rounds (no extra pytest arguments) of `commit` and of every commit
    whose files under test are identical to its. A commit git does not know matches only
    itself."""
    code: dict[str, str | None] = {}

    def same(other: str) -> bool:
        if other == commit:
            return True
        for c in (commit, other):
            if c not in code:
                code[c] = code_of(c, repo)
        return code[commit] is not None and code[other] == code[commit]

    return [r for r in records if not r.get("pytest_args") and same(r.get("commit", ""))]


def name_of(test: str) -> str:
    """Property and fuzzer draws differ between rounds: they count under one name."""
    drawn = "resume_property" in test or "test_an_accepted_combination_trains" in test
    return re.sub(r"\[.*\]$", "[draw]", test) if drawn else test


def print_counts(title: str, runs: collections.Counter[str], passed: collections.Counter[str]):
    width = max((len(n) for n in runs), default=10)
    print(f"\n{title}:")
    for name in sorted(runs):
        print(f"  {name:<{width}}  {passed[name]}/{runs[name]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", "20")))
    parser.add_argument("--draws", type=int, default=3, help="property draws per round")
    parser.add_argument("--flag-draws", type=int, default=6,
                        help="flag-space combinations trained per round")  # fmt: skip
    parser.add_argument("--seed", type=int, default=int(time.time()), help="first round's seed")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="PATH",
        default=None,
        help="these test files instead of every fault test (e.g. the fuzzer's "
        "two: tests/unit/test_flag_space.py tests/dist/test_flag_space.py)",
    )
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    passed: collections.Counter[str] = collections.Counter()
    runs: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    commit = clean_commit()
    for round_ in range(args.rounds):
        seed = args.seed + round_
        env = dict(os.environ, SCALETRAIN_STRESS_SEED=str(seed),
                   SCALETRAIN_RESUME_DRAWS=str(args.draws),
                   SCALETRAIN_FLAG_DRAWS=str(args.flag_draws))  # fmt: skip
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider",
             *(args.only or FAULT_TESTS), *(f"--deselect={t}" for t in NOT_FAULT_TESTS),
             *args.pytest_args],
            cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        results = RESULT.findall(proc.stdout)
        if proc.returncode:  # keep the whole output of a failing round to read
            log = LOGS / f"round{round_}-seed{seed}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(proc.stdout + "\n" + proc.stderr)
            failures.append(f"round {round_} (seed {seed}): output in {log}")
        if not results or proc.returncode not in (0, 1):  # collection error, abort, crash
            failures.append(f"round {round_} (seed {seed}): pytest exited {proc.returncode}")
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        for outcome, test in results:
            name = name_of(test)
            runs[name] += 1
            if outcome == "PASSED":
                passed[name] += 1
            else:
                failures.append(f"round {round_} (seed {seed}): {test} {outcome}")
        bad = sum(1 for o, _ in results if o != "PASSED")
        print(f"round {round_ + 1}/{args.rounds} seed {seed}: {len(results) - bad} passed, "
              f"{bad} failed, exit {proc.returncode}, {time.monotonic() - started:.0f} s",
              flush=True)  # fmt: skip
        if commit is not None:  # a crashed round too: it failed
            append_jsonl(LEDGER, {
                "commit": commit, "seed": seed, "exit": proc.returncode, "pytest_args":
                [*args.pytest_args, *(["--only", *args.only] if args.only else [])],
                "seconds": round(time.monotonic() - started),
                "unix_time": time.time(), "results": [list(r) for r in results],
            })  # fmt: skip
    print_counts("passes per test", runs, passed)
    if commit is not None:
        rounds = rounds_of_the_same_code(read_jsonl(LEDGER), commit)
        commits = collections.Counter(r["commit"][:12] for r in rounds)
        all_runs: collections.Counter[str] = collections.Counter()
        all_passed: collections.Counter[str] = collections.Counter()
        for record in rounds:
            for outcome, test in record["results"]:
                all_runs[name_of(test)] += 1
                all_passed[name_of(test)] += outcome == "PASSED"
        print_counts(f"every round recorded for the code of commit {commit[:12]} ({len(rounds)} "
                     f"rounds, {sum(r['exit'] != 0 for r in rounds)} of them failing; by commit, "
                     f"each with the same files under test: "
                     f"{', '.join(f'{c} {n}' for c, n in commits.items())})",
                     all_runs, all_passed)  # fmt: skip
    else:
        print("\n(a modified checkout: these rounds are not recorded in the ledger)")
    for line in failures:
        print(f"FAILED {line}")
    print(f"{sum(passed.values())} passed, {sum(runs.values()) - sum(passed.values())} failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
