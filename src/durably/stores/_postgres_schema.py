"""The PostgreSQL schema, as an ordered list of migrations.

Tables and columns mirror :mod:`._sqlite_schema` one for one: times are
``BIGINT`` epoch milliseconds, JSON values are text, except ``tags``, which is
``jsonb`` under a GIN index so the tag filter of ``list_runs`` is indexed.

The store applies whatever migrations a database has not seen, in one
transaction holding an advisory lock (so processes starting together never
migrate twice), and records the version reached in ``durably_meta``.
Append new migrations; never edit one that has shipped.
"""

from __future__ import annotations

MIGRATIONS: list[str] = [
    # 1: runs, checkpoints, signal waiters and buffered signals
    """
    CREATE TABLE durably_runs (
        id TEXT PRIMARY KEY,
        workflow TEXT NOT NULL,
        workflow_version TEXT NOT NULL,
        status TEXT NOT NULL,
        namespace TEXT NOT NULL DEFAULT 'default',
        parent_id TEXT,
        input TEXT,
        output TEXT,
        error TEXT,
        tags JSONB NOT NULL DEFAULT '[]'::jsonb,
        priority INTEGER NOT NULL DEFAULT 0,
        wake_at BIGINT,
        wake_requested_at BIGINT,
        locked_by TEXT,
        locked_until BIGINT,
        recovery_attempts INTEGER NOT NULL DEFAULT 0,
        deadline_at BIGINT,
        awaiting_decision_task_id TEXT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL
    );
    -- list_due / claim_due: suspended runs by wake time
    CREATE INDEX durably_runs_due ON durably_runs (status, wake_at);
    CREATE INDEX durably_runs_wake_requested ON durably_runs (wake_requested_at)
        WHERE wake_requested_at IS NOT NULL;
    -- list_orphans / recover_orphan: running runs by lease expiry
    CREATE INDEX durably_runs_orphans ON durably_runs (status, locked_until);
    -- list_pending: most urgent priority, then oldest
    CREATE INDEX durably_runs_pending ON durably_runs (priority DESC, created_at, id)
        WHERE status = 'pending';
    -- list_expired: live runs past their deadline
    CREATE INDEX durably_runs_deadline ON durably_runs (deadline_at)
        WHERE deadline_at IS NOT NULL;
    -- children of a parent
    CREATE INDEX durably_runs_parent ON durably_runs (parent_id, created_at DESC, id DESC)
        WHERE parent_id IS NOT NULL;
    -- list_runs: newest first, overall and by each equality filter
    CREATE INDEX durably_runs_listing ON durably_runs (created_at DESC, id DESC);
    CREATE INDEX durably_runs_status_listing
        ON durably_runs (status, created_at DESC, id DESC);
    CREATE INDEX durably_runs_workflow ON durably_runs (workflow, created_at DESC, id DESC);
    CREATE INDEX durably_runs_namespace ON durably_runs (namespace, created_at DESC, id DESC);
    CREATE INDEX durably_runs_tags ON durably_runs USING GIN (tags jsonb_path_ops);

    CREATE TABLE durably_checkpoints (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        input TEXT,
        output TEXT,
        error TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        wake_at BIGINT,
        started_at BIGINT,
        finished_at BIGINT,
        PRIMARY KEY (run_id, seq)
    );

    CREATE TABLE durably_signal_waiters (
        token TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL
    );
    CREATE INDEX durably_signal_waiters_run ON durably_signal_waiters (run_id);

    CREATE TABLE durably_buffered_signals (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        token TEXT NOT NULL,
        payload TEXT,
        created_at BIGINT NOT NULL
    );
    CREATE INDEX durably_buffered_signals_token ON durably_buffered_signals (token, id);
    """,
    # 2: children report to (parent_id, parent_seq); a durable cancel intent;
    # fan-out checkpoints carry their group, so a child can tell when it was the last
    """
    ALTER TABLE durably_runs ADD COLUMN parent_seq INTEGER;
    ALTER TABLE durably_runs ADD COLUMN cancel_requested TEXT;
    ALTER TABLE durably_checkpoints ADD COLUMN parallel_group TEXT;
    CREATE INDEX durably_checkpoints_group ON durably_checkpoints (run_id, parallel_group, status)
        WHERE parallel_group IS NOT NULL;
    CREATE INDEX durably_runs_updated ON durably_runs (status, updated_at);
    """,
    # 3: schedules; event waiters, buffered events and published event ids
    """
    CREATE TABLE durably_schedules (
        name TEXT PRIMARY KEY,
        namespace TEXT NOT NULL DEFAULT 'default',
        spec TEXT NOT NULL,
        paused BOOLEAN NOT NULL DEFAULT false,
        next_fire_at BIGINT,
        last_fired_at BIGINT,
        last_run_id TEXT,
        firing_run_id TEXT,
        revision BIGINT NOT NULL DEFAULT 0,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL
    );
    -- list_due_schedules: unpaused by next window, and claimed starts to confirm
    CREATE INDEX durably_schedules_due ON durably_schedules (namespace, next_fire_at)
        WHERE NOT paused;
    CREATE INDEX durably_schedules_firing ON durably_schedules (namespace)
        WHERE firing_run_id IS NOT NULL;

    -- publish_event looks waiters up by the payload projected on each key set
    CREATE TABLE durably_event_waiters (
        run_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        name TEXT NOT NULL,
        match_keys TEXT NOT NULL,
        match TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        PRIMARY KEY (run_id, seq)
    );
    CREATE INDEX durably_event_waiters_match
        ON durably_event_waiters (name, match_keys, match);

    CREATE TABLE durably_buffered_events (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        name TEXT NOT NULL,
        event_id TEXT,
        payload TEXT NOT NULL,
        created_at BIGINT NOT NULL
    );
    CREATE INDEX durably_buffered_events_name ON durably_buffered_events (name, id);

    -- publish_event(id=…) is idempotent: the ids already published
    CREATE TABLE durably_published_events (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        recipients INTEGER NOT NULL,
        published_at BIGINT NOT NULL
    );
    CREATE INDEX durably_published_events_time ON durably_published_events (published_at);
    """,
    # 4: dispatched steps (dispatch time, redispatches, the flow-control queue
    # holding their slot, the newest heartbeat and its progress); flow-control
    # slots (released rows kept for the rate window) and waiters
    """
    ALTER TABLE durably_checkpoints ADD COLUMN dispatched_at BIGINT;
    ALTER TABLE durably_checkpoints ADD COLUMN redispatches INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE durably_checkpoints ADD COLUMN queue TEXT;
    ALTER TABLE durably_checkpoints ADD COLUMN last_heartbeat_at BIGINT;
    ALTER TABLE durably_checkpoints ADD COLUMN progress TEXT;

    -- try_admit counts held slots (per fairness key) and admissions in the rate window
    CREATE TABLE durably_flow_slots (
        queue TEXT NOT NULL,
        step_id TEXT NOT NULL,
        run_id TEXT NOT NULL,
        fairness_key TEXT NOT NULL,
        acquired_at BIGINT NOT NULL,
        released_at BIGINT,
        PRIMARY KEY (queue, step_id)
    );
    CREATE INDEX durably_flow_slots_held ON durably_flow_slots (queue, fairness_key)
        WHERE released_at IS NULL;
    CREATE INDEX durably_flow_slots_window ON durably_flow_slots (queue, acquired_at);
    -- release_slots: the slots a run's steps hold
    CREATE INDEX durably_flow_slots_run ON durably_flow_slots (run_id)
        WHERE released_at IS NULL;

    -- steps refused a slot, ranked by priority, fairness and age
    CREATE TABLE durably_flow_waiters (
        queue TEXT NOT NULL,
        step_id TEXT NOT NULL,
        run_id TEXT NOT NULL,
        priority INTEGER NOT NULL,
        fairness_key TEXT NOT NULL,
        enqueued_at BIGINT NOT NULL,
        seen_at BIGINT NOT NULL,
        PRIMARY KEY (queue, step_id)
    );
    CREATE INDEX durably_flow_waiters_order
        ON durably_flow_waiters (queue, priority DESC, enqueued_at);
    CREATE INDEX durably_flow_waiters_seen ON durably_flow_waiters (queue, seen_at);
    CREATE INDEX durably_flow_waiters_run ON durably_flow_waiters (run_id);
    """,
    # 5: a dispatched step's log lines and sub-process events (JSON), stored
    # with the result that settled it
    """
    ALTER TABLE durably_checkpoints ADD COLUMN events TEXT;
    """,
    # 6: several waiters per signal token, served in the order they registered
    # (id): the token no longer keys the table, one wait (run, seq, token) does
    """
    ALTER TABLE durably_signal_waiters DROP CONSTRAINT durably_signal_waiters_pkey;
    ALTER TABLE durably_signal_waiters
        ADD COLUMN id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY;
    DROP INDEX durably_signal_waiters_run;
    CREATE UNIQUE INDEX durably_signal_waiters_wait
        ON durably_signal_waiters (run_id, seq, token);
    CREATE INDEX durably_signal_waiters_token ON durably_signal_waiters (token, id);
    """,
    # 7: the trace context a tracing interceptor stores on a run at its start,
    # continued by every turn of the run in any process
    """
    ALTER TABLE durably_runs ADD COLUMN trace_context TEXT;
    """,
    # 8: the dashboard's queries (bench/dashboard.py explains each): search by
    # id prefix (a byte-order index, so a range on it is a prefix whatever the
    # database's collation), the counts per status of one workflow (read from
    # the index alone), and the live view's "changed since" poll
    """
    CREATE INDEX durably_runs_id_prefix ON durably_runs (id COLLATE "C");
    CREATE INDEX durably_runs_workflow_status ON durably_runs (workflow, status);
    CREATE INDEX durably_runs_updated_at ON durably_runs (updated_at);
    """,
    # 9: search attributes, one row per (run, key), typed; list_runs filters
    # through an index on (key, value), never by scanning JSON. Text compares
    # by code point (COLLATE "C"), as on SQLite and in memory, whatever the
    # database's collation.
    """
    CREATE TABLE durably_run_attributes (
        run_id TEXT NOT NULL,
        key TEXT NOT NULL,
        type TEXT NOT NULL,
        str_value TEXT COLLATE "C",
        num_value DOUBLE PRECISION,
        PRIMARY KEY (run_id, key)
    );
    CREATE INDEX durably_run_attributes_str ON durably_run_attributes (key, str_value, run_id);
    CREATE INDEX durably_run_attributes_num ON durably_run_attributes (key, num_value, run_id);
    """,
    # 10: each run's inbox of updates (engine.update) and their answers, in
    # arrival order (id); an update id is unique per run (a retried delivery)
    """
    CREATE TABLE durably_updates (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        run_id TEXT NOT NULL,
        update_id TEXT NOT NULL,
        name TEXT NOT NULL,
        payload TEXT,
        created_at BIGINT NOT NULL,
        answer TEXT,
        answered_at BIGINT
    );
    CREATE UNIQUE INDEX durably_updates_id ON durably_updates (run_id, update_id);
    CREATE INDEX durably_updates_pending ON durably_updates (run_id, id) WHERE answer IS NULL;
    """,
    # 11: a run some process waits for from outside the one executing it
    # (watch_runs): only its settles are announced (NOTIFY), so a run nobody
    # watches from elsewhere wakes no listener when it settles
    """
    ALTER TABLE durably_runs ADD COLUMN watched BOOLEAN NOT NULL DEFAULT false;
    """,
    # 12: fewer index entries per write of a run (bench/writes.py; every write
    # of a run is a new row version in every index whose columns it changes,
    # so a one-step run wrote 27 entries). The due timers and the orphan sweep
    # only ever read one status ('suspended', 'running'; each query says so
    # literally, so the planner proves the predicate): a run leased at its
    # start or finished writes no entry into the first, a finished one none
    # into the second. The tag filter only matches runs with tags (list_runs
    # says so literally), so untagged runs stay out of the GIN index.
    """
    DROP INDEX durably_runs_due;
    CREATE INDEX durably_runs_due ON durably_runs (wake_at) WHERE status = 'suspended';
    DROP INDEX durably_runs_orphans;
    CREATE INDEX durably_runs_orphans ON durably_runs (locked_until) WHERE status = 'running';
    DROP INDEX durably_runs_tags;
    CREATE INDEX durably_runs_tags ON durably_runs USING GIN (tags jsonb_path_ops)
        WHERE tags <> '[]'::jsonb;
    """,
    # 13: each poll's partial index is the only index its status test matches
    # (stores/_pg_sql.polled). With runs put to sleep since the last ANALYZE,
    # a plain status = 'suspended' made durably_runs_updated (status, ...) as
    # cheap as the poll's own index under the generic plan, and a poll read
    # and sorted every sleeping run (tests/stores/test_postgres_poll_plans.py).
    # The predicates below are written exactly as the polls write them; no
    # index led by status can answer that form. The due index carries the
    # poll's whole order (wake_at, id): on (wake_at) alone, a "one row"
    # estimate sorted every due run for a page of them. The wake-requested
    # branches check the status only (SUSPENDED), so their own index is the
    # one they match.
    """
    DROP INDEX IF EXISTS durably_runs_due;
    CREATE INDEX durably_runs_due ON durably_runs (wake_at, id)
        WHERE (status = 'suspended') IS NOT FALSE;
    DROP INDEX IF EXISTS durably_runs_orphans;
    CREATE INDEX durably_runs_orphans ON durably_runs (locked_until)
        WHERE (status = 'running') IS NOT FALSE;
    DROP INDEX IF EXISTS durably_runs_pending;
    CREATE INDEX durably_runs_pending ON durably_runs (priority DESC, created_at, id)
        WHERE (status = 'pending') IS NOT FALSE;
    """,
    # 14: fewer, cheaper index entries per run version (bench/RESULTS.md,
    # "Index entries per run version", issue 18). A status change is never a
    # HOT update, so every version of a run enters every index it qualifies
    # for; at 1,000,000 runs each entry into an index whose new keys land
    # mid-tree costs a descent of 3 pages, one at the right end of an
    # ascending index 1 (PostgreSQL's rightmost-leaf fast path).
    # - No index is led by status over every run any more: the status-led
    #   indexes hold only finished runs (the only status sets large enough
    #   to need them), so a live run's versions skip them and no live-run
    #   query can be planned on them under stale statistics. Live statuses
    #   are found through their own partial indexes (pending, due, orphans,
    #   and blocked below); list_runs/count_runs write each status in the
    #   form its index matches (stores/_pg_sql.status_match).
    # - durably_runs_updated (status, updated_at) is gone: the retention
    #   sweep walks durably_runs_updated_at and checks the status, the
    #   stalled sweep reads the due and orphan indexes.
    # - The listing and namespace indexes ascend (a backward scan serves
    #   newest first): a new run's key is the largest, so its entry goes to
    #   the rightmost leaf without a descent.
    # Built before the drops: a build only holds writes back (SHARE lock);
    # a DROP INDEX blocks reads too, until the migration commits.
    """
    CREATE INDEX durably_runs_finished ON durably_runs (status, created_at, id)
        WHERE status IN ('cancelled', 'completed', 'dead', 'failed');
    CREATE INDEX durably_runs_workflow_finished ON durably_runs (workflow, status)
        WHERE status IN ('cancelled', 'completed', 'dead', 'failed');
    CREATE INDEX durably_runs_blocked ON durably_runs (priority DESC, created_at, id)
        WHERE status = 'blocked';
    CREATE INDEX durably_runs_created ON durably_runs (created_at, id);
    CREATE INDEX durably_runs_namespace_created ON durably_runs (namespace, created_at, id);
    DROP INDEX IF EXISTS durably_runs_updated;
    DROP INDEX IF EXISTS durably_runs_status_listing;
    DROP INDEX IF EXISTS durably_runs_workflow_status;
    DROP INDEX IF EXISTS durably_runs_listing;
    DROP INDEX IF EXISTS durably_runs_namespace;
    """,
    # 15: the workflow and parent listings ascend too (bench/RESULTS.md,
    # "Listings by workflow and parent ascend", issue 18). With created_at
    # DESC a new run's entry went to the left end of its range, so every
    # insert descended the tree and each full leaf split 50/50 (PostgreSQL's
    # split after a new tuple is for keys no wider than two bigints).
    # Ascending, a run in the range that sorts last (the newest parent's
    # children, ids being time-ordered; the last workflow name) enters the
    # rightmost leaf without a descent, and that leaf splits leaving the
    # left page full. A backward scan serves created_at DESC, id DESC and
    # the cursor unchanged. Built before the drops, as in 14.
    """
    CREATE INDEX durably_runs_workflow_created ON durably_runs (workflow, created_at, id);
    CREATE INDEX durably_runs_parent_created ON durably_runs (parent_id, created_at, id)
        WHERE parent_id IS NOT NULL;
    DROP INDEX IF EXISTS durably_runs_workflow;
    DROP INDEX IF EXISTS durably_runs_parent;
    """,
    # 16: at 1,000,000 finished runs, a run costs what it costs in an empty
    # database (bench/RESULTS.md, "The grow criterion settled; completed runs
    # at the right end, runs vacuumed by churn", issue 18).
    # - durably_runs_completed: the completed runs have their own index, in
    #   start order, so a run completing enters its rightmost leaf without a
    #   descent (PostgreSQL's fast path), as the listing indexes do. In
    #   durably_runs_finished (status, ...) 'completed' sorts before 'dead'
    #   and 'failed', so once any run had failed each completed run descended
    #   the tree (3 pages at 1M) and split its leaves 50/50. The other
    #   finished statuses, rarer, keep the status-led index.
    # - Vacuumed by churn, indexes included: a run's status changes are
    #   never HOT updates, so each version enters the live-status partial
    #   indexes (pending, due, orphans, blocked) at their right end and
    #   leaves a dead entry; only VACUUM's index pass frees a leaf page of
    #   them, and until then every poll from the left end reads it. By
    #   default autovacuum waits for dead rows worth 20% of the table
    #   (200,000 at 1M) and then skips the index pass when under 2% of the
    #   heap pages hold dead rows, as the live runs of a large table do. A
    #   scale of 2% keeps the wait proportionate (each vacuum's index pass
    #   reads every index, whose size is the table's); vacuum_index_cleanup
    #   = on makes each vacuum free those pages. (ShareUpdateExclusiveLock.)
    # Built before the drop, as in 14.
    """
    CREATE INDEX durably_runs_completed ON durably_runs (created_at, id)
        WHERE status = 'completed';
    CREATE INDEX durably_runs_unsuccessful ON durably_runs (status, created_at, id)
        WHERE status IN ('cancelled', 'dead', 'failed');
    DROP INDEX IF EXISTS durably_runs_finished;
    ALTER TABLE durably_runs SET (
        autovacuum_vacuum_scale_factor = 0.02,
        vacuum_index_cleanup = on
    );
    """,
]
