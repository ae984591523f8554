# ruff: noqa: E501 (test ids are long, and one is easier to find whole)
"""The mutation catalog of ``make mutants`` (scripts/mutants.py): for each promise the docs
make, the smallest source edit that breaks it and the tests of ``make test`` that must then
fail. An entry whose text no longer occurs exactly once in its file fails the run: when code
moves, the entry moves with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    promise: str
    path: str
    old: str
    new: str
    tests: list[str]


SRC = "src/scaletrain/"
PS = SRC + "strategies/param_server/"
U, D, E = "tests/unit/", "tests/dist/", "tests/e2e/"

CATALOG = [
    # -- data plans and the sampler -----------------------------------------------------
    Mutation(
        "split-extra-sample",
        "data",
        "a step's samples split over the ranks, each once",
        SRC + "data/partition.py",
        "return [base + (1 if r < extra else 0) for r in range(world_size)]",
        "return [base + (1 if r <= extra else 0) for r in range(world_size)]",
        [U + "test_partition.py::test_split_counts_and_slices"],
    ),
    Mutation(
        "epoch-order-ignores-epoch",
        "data",
        "each epoch has its own order, a pure function of seed and epoch",
        SRC + "data/partition.py",
        "rng = np.random.Generator(np.random.PCG64([seed, epoch]))",
        "rng = np.random.Generator(np.random.PCG64([seed, 0]))",
        [U + "test_partition.py::test_epoch_order_depends_on_seed_and_epoch_only"],
    ),
    Mutation(
        "drop-last-keeps-short-step",
        "data",
        "--drop-last drops the epoch's short last step",
        SRC + "data/partition.py",
        "        bounds.pop()\n",
        "        pass\n",
        [U + "test_partition.py::test_drop_last_keeps_only_full_steps"],
    ),
    Mutation(
        "cursor-not-advanced",
        "data",
        "a committed step advances the resume cursor",
        SRC + "data/sampler.py",
        "        self.cursor += global_samples\n",
        "        self.cursor = global_samples\n",
        [U + "test_partition.py::test_resize_and_resume_mid_epoch_train_each_sample_once"],
    ),
    Mutation(
        "cursor-not-restored",
        "resume",
        "a restored run continues mid-epoch at its cursor",
        SRC + "data/sampler.py",
        'self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])',
        'self.epoch, self.cursor = int(state["epoch"]), 0',
        [
            D
            + "test_recovery.py::test_killed_worker_restarts_from_checkpoint_with_identical_weights"
        ],
    ),
    Mutation(
        "resize-keeps-old-shares",
        "elastic",
        "a resized world starts with equal shares, every sample once",
        SRC + "data/sampler.py",
        "self.shares = list(shares) if shares and len(shares) == self.world_size else None",
        "self.shares = list(shares) if shares else None",
        [U + "test_partition.py::test_balanced_shares_carry_over_only_to_a_world_of_their_size"],
    ),
    # -- sample-weighted gradients, each strategy equal to one process ------------------
    Mutation(
        "ddp-unweighted",
        "gradients",
        "ddp averages gradients weighted by samples",
        SRC + "strategies/ddp.py",
        "scale = batch.num_samples * self.ctx.world_size / batch.global_samples",
        "scale = 1.0",
        [D + "test_equivalence.py::test_n_workers_match_one_worker_with_n_times_the_batch"],
    ),
    Mutation(
        "fsdp-unweighted",
        "gradients",
        "fsdp equals one process, weighted by samples",
        SRC + "strategies/fsdp.py",
        "scale = batch.num_samples * self.dp / batch.global_samples",
        "scale = 1.0",
        [D + "test_fsdp.py::test_fsdp_matches_one_process"],
    ),
    Mutation(
        "tensor-dp-unweighted",
        "gradients",
        "tensor x data parallel equals one process",
        SRC + "strategies/tensor.py",
        "flat.mul_(batch.num_samples / batch.global_samples)",
        "flat.mul_(0.5)",
        [D + "test_tensor.py::test_tensor_parallel_times_data_parallel"],
    ),
    Mutation(
        "pipeline-dp-unweighted",
        "gradients",
        "pipelines x data parallel equal one process",
        SRC + "strategies/pipeline.py",
        "flat.mul_(batch.num_samples / batch.global_samples)",
        "flat.mul_(1.0)",
        [D + "test_pipeline.py::test_pipelines_times_data_parallel"],
    ),
    Mutation(
        "local-sgd-never-syncs",
        "strategies",
        "local SGD synchronizes every --sync-every steps",
        SRC + "strategies/local_sgd.py",
        "if self.local_steps % self.sync_every == 0:",
        "if self.local_steps % self.sync_every == -1:",
        [D + "test_communication.py::test_degenerate_settings_equal_sync_ddp"],
    ),
    Mutation(
        "diloco-delta-sign",
        "strategies",
        "DiLoCo's outer step moves along the averaged pseudo-gradient",
        SRC + "strategies/diloco.py",
        "deltas = [g - p.detach() for g, p in zip(self.global_params, local, strict=True)]",
        "deltas = [p.detach() - g for g, p in zip(self.global_params, local, strict=True)]",
        [D + "test_communication.py::test_degenerate_settings_equal_sync_ddp"],
    ),
    # -- checkpoints ---------------------------------------------------------------------
    Mutation(
        "checkpoint-written-in-place",
        "checkpoints",
        "a failed write leaves the previous checkpoint intact and no torn file",
        SRC + "fault/checkpoint.py",
        "        atomic_write_bytes(path, data)\n        entry =",
        "        path.write_bytes(data)\n        entry =",
        [U + "test_fault.py::test_full_disk_keeps_the_previous_checkpoint_and_says_so"],
    ),
    Mutation(
        "checkpoint-checksum-ignored",
        "checkpoints",
        "a damaged checkpoint is skipped for the previous one",
        SRC + "fault/checkpoint.py",
        'if hashlib.sha256(data).hexdigest() != entry["sha256"]:',
        "if False:",
        [U + "test_fault.py::test_checkpoints_keep_the_newest_and_skip_damaged_ones"],
    ),
    Mutation(
        "rank-state-checksum-ignored",
        "checkpoints",
        "a rank's own state file carries its checksum",
        SRC + "fault/checkpoint.py",
        "if not head.startswith(_DIGEST) or hashlib.sha256(data)",
        "if not head.startswith(_DIGEST) and hashlib.sha256(data)",
        [U + "test_fault.py::test_per_rank_state_files_carry_their_own_checksum"],
    ),
    Mutation(
        "index-without-fallback",
        "checkpoints",
        "a damaged index is read as its previous generation",
        SRC + "fault/checkpoint.py",
        "for name in (CHECKPOINT_INDEX, PREVIOUS_INDEX):",
        "for name in (CHECKPOINT_INDEX,):",
        [U + "test_fault.py::test_a_damaged_index_is_read_as_its_previous_generation"],
    ),
    Mutation(
        "rng-not-restored",
        "resume",
        "every rank resumes its own random streams",
        SRC + "fault/recovery.py",
        "        set_rng_state(rng)\n",
        "        pass\n",
        [D + "test_recovery.py::test_per_rank_random_streams_continue_exactly_after_a_restart"],
    ),
    # -- preemption ----------------------------------------------------------------------
    Mutation(
        "guard-not-installed",
        "preemption",
        "a preemption signal at start-up exits 3, never 143",
        SRC + "cli.py",
        "        GUARD.install()\n",
        "        pass\n",
        [
            D
            + "test_preempt_anytime.py::test_a_signal_at_any_moment_exits_3_or_0_and_the_job_ends_the_same"
        ],
    ),
    Mutation(
        "signal-kills-at-exit",
        "preemption",
        "a signal in the last instants of a finished job changes nothing (exit 0)",
        SRC + "launch/leaving.py",
        "    if GUARD.installed:",
        "    if False:",
        [
            D
            + "test_preempt_anytime.py::test_signals_from_the_final_line_until_the_process_is_gone_change_nothing"
        ],
    ),
    Mutation(
        "preemption-never-checked",
        "preemption",
        "a preempted job checkpoints, exits 3, and continues bit for bit",
        SRC + "lifecycle.py",
        "            return False\n        asked = preempt_path(loop.run_dir).exists()\n"
        "        return not self._all_agree",
        "            return False\n        asked = False\n        return not self._all_agree",
        [
            D
            + "test_preempt_anytime.py::test_a_signal_at_any_moment_exits_3_or_0_and_the_job_ends_the_same"
        ],
    ),
    # -- in place: quorum and heal (ddp, HSDP, local SGD, DiLoCo) ---------------------------
    Mutation(
        "inplace-heal-not-loaded",
        "in place",
        "a restarted replica heals from a live peer's state",
        SRC + "strategies/inplace.py",
        "            load(state)\n            self.after_heal(state)",
        "            self.after_heal(state)",
        [D + "test_inplace.py::test_survivors_continue_and_a_restarted_worker_rejoins"],
    ),
    Mutation(
        "inplace-ddp-quorum-weight",
        "in place",
        "in place, a step's gradient is the sample-weighted mean over the quorum's participants",
        SRC + "strategies/inplace.py",
        "weight = batch.num_samples * n / batch.global_samples",
        "weight = batch.num_samples / batch.global_samples",
        [D + "test_inplace.py::test_ddp_in_place_trains_as_the_restart_mode_does"],
    ),
    Mutation(
        "hsdp-group-weight",
        "in place",
        "HSDP in place trains as the restart mode does, bit for bit",
        SRC + "strategies/inplace_hsdp.py",
        "weight = batch.num_samples * n * self.group_size / batch.global_samples",
        "weight = batch.num_samples * n / batch.global_samples",
        [D + "test_fsdp.py::test_hsdp_in_place_trains_as_the_restart_mode_does"],
    ),
    Mutation(
        "hsdp-heal-not-loaded",
        "in place",
        "a group heals its shards from a live group",
        SRC + "strategies/inplace_hsdp.py",
        '        load_local(self.module.state_dict(), state["model"])\n',
        "",
        [
            D
            + "test_inplace_hsdp.py::test_a_killed_rank_takes_its_group_out_and_the_group_heals_from_a_live_one"
        ],
    ),
    Mutation(
        "inplace-diloco-delta-sign",
        "in place",
        "DiLoCo in place trains as the restart mode does, bit for bit",
        SRC + "strategies/inplace_rounds.py",
        "parts = [g - p.detach() for g, p in zip(self.global_params, params, strict=True)]",
        "parts = [p.detach() - g for g, p in zip(self.global_params, params, strict=True)]",
        [D + "test_inplace_rounds.py::test_in_place_rounds_train_as_the_restart_mode_does"],
    ),
    # -- communication and hangs ------------------------------------------------------------
    Mutation(
        "topk-drops-residual",
        "compression",
        "top-k's error feedback loses nothing",
        SRC + "compression/topk.py",
        "        self.residuals.set(key, corrected)\n",
        "",
        [U + "test_compression.py::test_error_feedback_loses_nothing"],
    ),
    Mutation(
        "hang-blames-nobody",
        "watchdog",
        "a hang names the rank that never reached the collective",
        SRC + "fault/watchdog.py",
        "culprits = sorted(silent + busy) if waiting else silent",
        "culprits = silent",
        [U + "test_fault.py::test_diagnose_names_the_rank_that_did_not_reach_the_collective"],
    ),
    # -- the parameter server ------------------------------------------------------------
    Mutation(
        "bsp-resend-applied-twice",
        "parameter server",
        "bsp: a push sent again after a server death is applied once",
        PS + "server.py",
        "if self.applied_step.get(worker) == (self.sessions.get(worker), step):",
        "if False:",
        [
            D
            + "test_ps_replicas.py::test_bsp_through_kills_of_primaries_and_backups_ends_bitwise_as_without_them"
        ],
    ),
    Mutation(
        "asp-resend-applied-twice",
        "parameter server",
        "asp: a push sent again after a server death is applied once",
        PS + "server.py",
        "if seen is not None and seen[0] == push[0] and seen[1] >= push[1]:",
        "if False:",
        [
            D
            + "test_ps_replicas.py::test_asp_a_push_acknowledged_by_the_backup_but_not_answered_is_applied_once"
        ],
    ),
    Mutation(
        "reply-before-forward",
        "parameter server",
        "a push is acknowledged only once the backup holds it",
        PS + "server.py",
        '        holds what it tells of first (--ps-replicas)."""\n        self._replicate()\n',
        '        holds what it tells of first (--ps-replicas)."""\n',
        [
            D
            + "test_ps_replicas.py::test_bsp_through_kills_of_primaries_and_backups_ends_bitwise_as_without_them"
        ],
    ),
    Mutation(
        "backup-sized-as-own-slice",
        "parameter server",
        "every server count trains with backups, slices of two lengths included",
        PS + "server.py",
        "param=flat[blo:bhi],",
        "param=self.param,",
        [D + "test_ps_replicas.py::test_uneven_slices_are_backed_up_and_train_as_without_backups"],
    ),
    Mutation(
        "backup-bug-waits-out-timeout",
        "parameter server",
        "a backup's bug ends the job at once, not after a timeout",
        SRC + "fault/internal.py",
        "                die_internal(what, e)\n",
        "                log.info('%s: %s', what, e)\n",
        [
            D
            + "test_ps_replicas.py::test_a_backup_that_fails_but_not_by_a_death_ends_its_process_at_once"
        ],
    ),
    Mutation(
        "no-takeover",
        "parameter server",
        "a server lost for good is taken over by its backup's process",
        SRC + "launch/ps.py",
        "            self.store.set(promote_key(k), str(backup))\n",
        "            pass\n",
        [
            D
            + "test_ps_replicas.py::test_bsp_through_kills_of_primaries_and_backups_ends_bitwise_as_without_them"
        ],
    ),
    Mutation(
        "ssp-bound-off-by-one",
        "parameter server",
        "ssp: no worker runs more than --staleness steps ahead of the slowest",
        PS + "consistency.py",
        "return clock - slowest <= staleness",
        "return clock - slowest <= staleness + 1",
        [U + "test_ps_rules.py::test_bounded_staleness_rule"],
    ),
    Mutation(
        "staleness-rule-ignored",
        "parameter server",
        "asp, ssp: a push of staleness s moves the parameters by --lr / (1 + s)",
        PS + "consistency.py",
        "        return 1.0 / (1 + staleness)\n",
        "        return 1.0\n",
        [U + "test_ps_rules.py::test_each_staleness_rule_scales_a_push_as_documented"],
    ),
    Mutation(
        "bsp-barrier-open",
        "parameter server",
        "bsp: a step is applied once every worker pushed (equals synchronous data parallel)",
        PS + "server.py",
        "        missing = self._expected() - self.arrived\n",
        "        missing = set()\n",
        [D + "test_param_server.py::test_bsp_equals_synchronous_data_parallel"],
    ),
    Mutation(
        "cut-copied-without-its-pushes",
        "parameter server",
        "a cut's copies on every server hold the same pushes",
        PS + "server.py",
        "if self._await_pushes(pushes) and not self.stop.is_set():",
        "if not self.stop.is_set():",
        [
            D
            + "test_ps_server.py::test_a_cut_copies_the_pushes_it_holds_and_holds_back_the_next_ones"
        ],
    ),
    Mutation(
        "differing-cut-continued",
        "parameter server",
        "a job continues only from a cut whose copies agree",
        PS + "cuts.py",
        "        if differ is None:\n",
        "        if True:\n",
        [U + "test_ps_rules.py::test_copies_of_a_cut_that_differ_are_not_continued_from"],
    ),
    Mutation(
        "ledger-line-lost",
        "parameter server",
        "server 0's ledger has every sample once per epoch",
        PS + "server.py",
        "                for line in book.ledger:\n",
        "                for line in book.ledger[:-1]:\n",
        [
            D
            + "test_ps_replicas.py::test_asp_a_push_acknowledged_by_the_backup_but_not_answered_is_applied_once"
        ],
    ),
    Mutation(
        "broken-link-never-relinked",
        "parameter server",
        "a primary-backup link that breaks "
        "with both alive is made again, and the slice copied again",
        PS + "replica.py",
        "        self.generation += 1\n        self.store.set(backup_key(self.slice), self.name)\n",
        "",
        [
            D
            + "test_ps_replicas.py::test_bsp_through_kills_of_primaries_and_backups_ends_bitwise_as_without_them"
        ],
    ),
    Mutation(
        "acknowledged-loss-silent",
        "parameter server",
        "acknowledged updates a restarted server lacks are counted and warned about, never silent",
        PS + "exposure.py",
        "if worker in self.answered or seen - self.restored <= self.lost:",
        "if True:",
        [
            D
            + "test_ps_replicas.py::test_a_primary_lost_while_its_restarted_backup_copies_is_counted_and_warned"
        ],
    ),
    Mutation(
        "dead-peer-not-watched",
        "parameter server",
        "a link whose peer died mid-message fails within a second, not at the link timeout",
        PS + "transport.py",
        "        while not job.done.wait(WATCH_S):\n            if self.store.check([self.peer_key]):",
        "        while not job.done.wait(WATCH_S):\n            if False:",
        [
            D
            + "test_ps_transport.py::test_a_send_whose_receiver_dies_mid_message_fails_with_peer_died"
        ],
    ),
    # -- the pre-start checks --------------------------------------------------------------
    Mutation(
        "eval-every-refused",
        "checks",
        "a valid flag is never refused (--eval-every N)",
        SRC + "config.py",
        '_require(self.eval_every >= 0, "eval_every"',
        '_require(self.eval_every == 0, "eval_every"',
        [
            U
            + "test_flag_space.py::test_every_documented_value_alone_is_accepted_where_its_mode_supports_it"
        ],
    ),
    Mutation(
        "replicas-with-one-server",
        "checks",
        "--ps-replicas with one server is refused before start",
        PS + "worker.py",
        "        if cfg.ps.ps_replicas and k < 2:",
        "        if cfg.ps.ps_replicas and k < 1:",
        [D + "test_ps_replicas.py::test_a_backup_is_refused_where_there_is_no_other_server"],
    ),
    Mutation(
        "ps-async-checkpoint-accepted",
        "checks",
        "a flag a mode would ignore is refused before start",
        SRC + "launch/modes.py",
        "        if cfg.fault.checkpoint_async:\n",
        "        if False:\n",
        [D + "test_modes.py::test_a_refused_flag_is_the_users_mistake_and_nothing_starts"],
    ),
    # -- the Python API and the command line -----------------------------------------------
    Mutation(
        "callers-main-run-again",
        "api",
        "scaletrain.run works from a script without a main guard and from stdin",
        SRC + "launch/forkserver.py",
        "    _keep_callers_main_out()\n",
        "    pass\n",
        [E + "test_python_api.py::test_run_from_a_script_without_a_main_guard"],
    ),
    # -- goodput and the cost model --------------------------------------------------------
    Mutation(
        "goodput-counts-redone-as-kept",
        "metrics",
        "steps trained again after a restart are lost time, not goodput",
        SRC + "metrics/goodput.py",
        "        (redone if thrown else kept).append((lo, hi - ckpt))\n",
        "        kept.append((lo, hi - ckpt))\n",
        [U + "test_goodput.py::test_a_restart_and_a_resume_itemized"],
    ),
    Mutation(
        "ring-allreduce-bytes",
        "cost model",
        "a ring all-reduce moves 2(k-1)/k of the bytes per rank",
        SRC + "analysis/costmodel.py",
        "return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth_Bps",
        "return 2 * (ranks - 1) * latency_s + (ranks - 1) / ranks * nbytes / bandwidth_Bps",
        [U + "test_costmodel.py::test_ring_allreduce_and_ddp_by_hand"],
    ),
]
