#!/usr/bin/env bash
# lockgate's integration tests against servers that refuse scripts: every
# redis-server and valkey-server the tests start has EVAL, EVALSHA,
# FUNCTION and FCALL renamed away (LOCKGATE_TEST_REDIS=noscript, see
# docs/development.md), so every lock operation is carried out as a
# WATCH/MULTI/EXEC transaction (src/lock/txn/).
#
#   scripts/noscript-tests.sh [extra cargo test filter arguments]
#
# The tests skipped below need scripts by design, each group for one reason
# (docs/faults.md, "Scripts refused"):
#   - the client's own scripts (EVAL, redis-py's Lock, Lua releases);
#   - counts of lockgate's scripts, fast scripts, MSETEX and NOSCRIPT reruns;
#   - transactions that mix lock commands with others (refused whole);
#   - the lock quorum (its masters run the lock scripts) and the queue
#     between instances (kept by the scripts);
#   - a test timed for the scripts' speed, and an ACL test that needs a
#     server with scripts to deny them;
#   - a silent primary's lock commands on the client's connection (without
#     scripts they run on lockgate's own, bounded by its call timeout).
# Under 2 minutes.
set -euo pipefail

# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LOCKGATE_ROOT"

SKIP=(
	# The client's own scripts.
	legacy_behaviour::deeply_nested_replies_pass_through
	locks_clients::raw_eval_release_sees_the_clients_value
	locks_clients::redis_py_lock_resp
	locks_watchdog::lua_released_watchdog_lock_is_not_renewed
	locks_watchdog::release_on_disconnect_spares_a_lock_taken_after_a_lua_release
	locks_view::a_script_that_lists_keys_frees_what_its_view_held
	passthrough_payloads::eval_evalsha_script_load_and_functions_match_redis
	shared_upstream::a_busy_script_leaves_the_other_clients_busy_replies_and_script_kill
	shared_upstream::lock_keys_keep_their_protection_in_shared_mode
	cluster_map::keys_are_found_as_the_server_finds_them
	# Owner records reconciled after a library's own script; libraries'
	# locks (their releases and Redisson's acquisition are scripts).
	locks_library::
	locks_library_release::
	locks_library_storm::
	locks_cross::
	locks_redisson::
	locks_redlock::
	locks_wake::
	ops_keys::
	# Counts of lockgate's scripts, fast scripts, natives, reruns.
	locks::setnx_is_one_eval_with_lease_and_owner_record
	locks_fast::
	locks_native::
	locks_noscript::
	storm_handoff::a_release_hands_the_lock_to_the_parked_attempt_in_one_step
	storm_handoff::a_storms_first_wave_sends_one_attempt_not_one_per_client
	storm_connections::attempts_behind_a_release_in_a_pipeline_answer_as_redis
	# The probe as a plain PTTL, which stands for a script call.
	storm_connections::a_probe_of_a_held_lock_is_one_pttl_and_a_freed_lock_is_still_taken
	# A transaction with lock commands and others (refused whole without
	# scripts), and outcomes inside MULTI that lockgate now sees and counts.
	locks_extend::persist_on_a_lock_key_is_refused_also_inside_multi
	locks_release::a_connection_that_lost_in_multi_may_release_the_holders_lock
	eviction::require_noeviction_refuses_lock_leases_until_the_policy_is_fixed
	replicas_ack_tx::grants_inside_multi_wait_for_the_replica_and_are_undone_without_it
	# The quorum's masters and the queue between instances.
	quorum
	storm_fleet::
	eviction::a_master_that_may_evict_sits_out_until_it_reads_noeviction
	ops::status_page_in_chromium_shows_a_hot_key_within_2s_and_a_killed_master_down
	# Timed for the scripts' speed: 100 000 pipelined acquisitions, one
	# transaction after another, outlast the hot keys' 30 s lease.
	ops::top_k_reports_three_hot_keys_among_100k_with_bounded_series_and_memory
	# In front of a Redis Cluster, locks need scripts (refused on a
	# cluster whose nodes refuse them: docs/cluster.md; the node cut off
	# holds a lock), and the
	# keyspace test loads a client script on every primary.
	cluster_locks::
	cluster_partition::
	cluster_routing::keyed_multi_key_and_keyspace_commands_reach_every_primary
	cluster_routing::cluster_aware_clients_work_through_lockgate
	differential::lock_traffic_in_front_of_a_cluster
	# ioredis's lock is released by the client's own Lua script.
	cluster_clients::
	# Replica acknowledgement in front of a cluster: its locks need scripts.
	replicas_ack_cluster::
	# A disputed slot's refusal is shown with locks, which need scripts on
	# a cluster.
	cluster_disputes::
	# Guarded writes run as scripts (on a server that refuses them they
	# are refused or passed unchecked: locks_scriptless tests that).
	guarded_faults::
	guarded_writes::
	# Shared, counted and multi-key locks, and MSETNX on lock keys, need
	# scripts (refused without them: lock_kinds tests that too).
	lock_kinds::every_kind
	lock_kinds::msetnx
	lock_kinds::operators
	lock_kinds::the_python
	lock_kinds::one_multiplexed
	kinds_faults::
	# Needs scripts present to deny them by ACL.
	locks_scriptless::an_acl_without_scripts_is_found_at_the_first_refusal
	# A silent primary leaves a lock command unanswered on the client's
	# connection (given up, or the session closed, by
	# upstream.lock_reply_timeout_ms): without scripts the lock commands
	# run as lockgate's own transactions on its own connection, bounded by
	# their call timeout, and only the plain commands go on the client's.
	partitions::a_blackholed_primary_answers_lock_commands_on_shared_connections_in_bounded_time
	partitions::a_blackholed_primary_closes_sessions_whose_lock_command_it_leaves_unanswered
)

args=()
for s in "${SKIP[@]}"; do
	args+=(--skip "$s")
done
LOCKGATE_TEST_REDIS=noscript exec cargo test --test it -- "${args[@]}" "$@"
