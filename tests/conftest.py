"""Test-session set-up shared by every test module.

Eight simulated CPU devices let the sharding tests build real meshes; the flag must be set before
jax is first imported, which is why it lives here and not in a fixture.
"""

import os
import pathlib
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, for the test processes and every process they start (the
# servers, trainers and benchmark scripts inherit the environment): the tests compile the same
# tiny models' steps and decoders again and again, in-process and in subprocesses, and a hit loads
# the executable XLA built the first time instead of building it again. Keyed by the program, the
# jax version and the flags, so a hit is the same executable; JAX_COMPILATION_CACHE_DIR= (empty)
# turns it off.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(tempfile.gettempdir()) / "sat_jax_test_jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax

jax.config.update("jax_enable_x64", False)


# Unit tests that take many seconds each (they compile a model's step or decoder several times, or
# train it for a few steps): `make test` runs them; `make test-fast` leaves them out, as it leaves
# out the tests marked slow, so that it stays under 4 minutes on 2 cores. Chosen by measured time
# (over ~5 s each on an idle core; README: Development), by file and test function (every
# parametrization). tests/test_fast_lane.py checks that each one still exists.
HEAVY_TESTS: dict[str, tuple[str, ...]] = {
    "tests/train/test_format_replay.py": (
        "test_server_records_which_tokens_each_format_constrained",
        "test_trainer_logprobs_equal_the_behavior_ones_at_lag_0",
        "test_a_token_the_replay_does_not_allow_rejects_the_group",
    ),
    "tests/sat_jax/step/test_format_masks.py": (
        "test_constrained_tokens_are_renormalized_over_their_mask",
        "test_microbatches_on_eight_devices_equal_one_pass",
        "test_a_batch_without_constrained_tokens_is_bit_identical",
    ),
    "tests/rollout_server/test_lora_install.py": (
        "test_served_weights_are_base_plus_scaled_product",
        "test_the_base_is_read_once_per_base_path",
    ),
    "tests/sat_jax/step/test_recipe_off.py": ("test_options_off_give_the_golden_step",),
    "tests/sat_jax/step/test_recipe_step.py": (
        "test_sampler_kl_is_zero_with_the_replay_and_not_over_the_whole_vocabulary",
        "test_recomputed_proximal_logprobs_equal_the_behavior_logprobs_at_lag_0",
        "test_recompute_refuses_a_batch_that_carries_old_logp",
    ),
    "tests/rollout_server/test_engine.py": (
        "test_behavior_logprobs_match_full_forward",
        "test_failed_prefill_never_raises_and_leaves_slot_empty",
        "test_swap_between_steps_versions_and_logprobs",
    ),
    "tests/rollout_server/test_sharded_engine.py": (
        "test_bfloat16_serving_keeps_its_kv_cache_in_bfloat16",
        "test_sharded_engine_equals_one_device_and_swaps_onto_its_shardings",
    ),
    "tests/sat_jax/model/test_attention.py": (
        "test_packed_segments_equal_each_sequence_alone",
        "test_layers_compile_once_whatever_the_depth",
        "test_blockwise_equals_dense_attention_and_gradient",
        "test_forward_paths_equal_the_dense_reference",
        "test_target_logprobs_equal_full_logits_and_never_build_them",
    ),
    "tests/sat_jax/model/test_decode.py": ("test_decode_logprobs_equal_full_forward",),
    "tests/sat_jax/model/test_hf.py": ("test_logits_and_routing_match_transformers",),
    "tests/sat_jax/model/test_hf_export.py": ("test_load_of_export_is_exact",),
    "tests/sat_jax/model/test_lora.py": (
        "test_fresh_adapters_give_bit_identical_logits",
        "test_fresh_adapters_give_bit_identical_prefill_and_decode",
        "test_trained_adapters_equal_the_merged_weights",
        "test_gradients_reach_the_adapters",
        "test_hf_import_with_lora_reads_the_base_and_makes_fresh_adapters",
    ),
    "tests/sat_jax/model/test_moe.py": (
        "test_balance_loss_is_k_at_uniform_routing_and_differentiable",
    ),
    "tests/sat_jax/model/test_tpu_kernels.py": (
        "test_gmm_equals_ragged_dispatch_and_gradient",
        "test_splash_per_shard_equals_dense",
        "test_gmm_per_shard_equals_dense",
        "test_model_with_tpu_kernels_equals_the_dense_reference",
    ),
    "tests/sat_jax/model/test_transformer.py": (
        "test_tied_embeddings_drop_the_output_head",
        "test_aux_loss_is_weighted_finite_and_differentiable",
        "test_dispatch_paths_agree_through_the_model",
        "test_masked_key_is_invisible_and_positions_are_honoured",
        "test_replaying_other_ids_changes_logits_and_trains_the_router",
    ),
    "tests/sat_jax/objectives/test_advantages.py": ("test_matches_reference",),
    "tests/sat_jax/test_decoding.py": (
        "test_decode_window_follows_the_live_length_and_equals_the_full_cache",
        "test_greedy_completions_follow_the_full_forward_and_stop_at_a_stop_id",
        "test_sampled_logprobs_are_the_behavior_policy",
        "test_sharded_core_equals_one_device",
        "test_truncated_sampling_is_replayed_by_the_trainers_logprobs",
    ),
    "tests/sat_jax/step/test_lora_step.py": (
        "test_only_the_adapters_change_and_the_base_is_bit_identical",
        "test_optimizer_state_covers_only_the_adapters",
        "test_microbatches_equal_one_pass",
        "test_sharded_step_matches_one_device",
        "test_reference_params_are_the_whole_model",
    ),
    "tests/train/test_packing.py": ("test_packed_step_equals_padded_step",),
    "tests/sat_jax/step/test_microbatches.py": (
        "test_reference_params_give_the_host_reference_logprobs_step",
        "test_rewards_and_group_ids_give_the_host_advantages_step",
        "test_microbatch_threshold_scope_uses_each_microbatch_quantile",
        "test_microbatches_equal_one_pass",
        "test_microbatches_on_eight_devices_with_replay",
    ),
    "tests/sat_jax/objectives/test_objectives.py": (
        "test_jit_matches_eager",
        "test_hypothesis_shapes_and_masks",
        "test_microbatches_with_the_batch_threshold_merge_to_full_batch",
        "test_sat_properties",
    ),
    "tests/sat_jax/test_params_io.py": ("test_saves_keep_no_objects_from_orbax_spec_resolution",),
    "tests/sat_jax/plan/test_plan.py": (
        "test_counts_match_the_architecture",
        "test_the_compiled_step_takes_the_truncation_replay_and_the_recomputed_proximal",
    ),
    "tests/sat_jax/test_sharding.py": ("test_init_sharded_places_each_param_as_the_rules_say",),
    "tests/sat_jax/step/test_train_step.py": (
        "test_alignment_logits_at_t_minus_1_score_token_t",
        "test_sharded_step_matches_one_device",
    ),
    "tests/sat_jax/model/test_lora_export.py": (
        "test_merged_export_matches_and_leaves_non_targets_bit_identical",
    ),
    "tests/train/test_export_eval.py": (
        "test_lora_eval_reads_base_plus_adapters_and_the_merged_export",
        "test_lora_export_and_eval_refuse_another_base",
    ),
    "tests/train/test_batching.py": ("test_bucketed_batch_trains_like_the_capacity_padded_one",),
    "tests/train/test_checkpointing.py": (
        "test_round_trip_keep_n_and_progress",
        "test_lora_checkpoint_holds_the_adapters_resumes_and_refuses_another_base",
        "test_base_fingerprint_is_exact_and_independent_of_the_sharding",
    ),
    "tests/train/test_held_out.py": ("test_greedy_completions_are_the_argmax_of_the_full_forward",),
    "tests/train/test_multi_turn.py": (
        "test_observation_values_change_neither_loss_metrics_nor_gradients",
    ),
    "tests/train/test_setup.py": ("test_base_policy_warms_up_through_the_configured_cache",),
    "tests/train/test_warmup.py": ("test_warmup_learns_and_is_cached",),
}


# Time limit of tests marked slow (end-to-end runs that start processes); every other test gets
# pyproject's `timeout`. A test's own @pytest.mark.timeout wins over both.
SLOW_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy = {f"{path}::{name}" for path, names in HEAVY_TESTS.items() for name in names}
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
        if item.nodeid.split("[", 1)[0] in heavy:
            item.add_marker(pytest.mark.heavy)
    items[:] = longest_files_first(items)


# Rough seconds of a test, by its marks, for the order of the files (`longest_files_first`).
SECONDS_SLOW, SECONDS_HEAVY, SECONDS_OTHER = 20.0, 8.0, 0.5


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files ordered by their estimated time (by marks), longest first; each file's tests in
    their order. `make test` hands out whole files to its two workers (`--dist loadfile`, so a
    module's fixtures, servers and compiled steps are built once): a long file handed out last
    would leave one worker running it alone at the end."""
    cost: dict[str, float] = {}
    for item in items:
        s = SECONDS_SLOW if item.get_closest_marker("slow") else SECONDS_OTHER
        s = SECONDS_HEAVY if item.get_closest_marker("heavy") and s < SECONDS_HEAVY else s
        path = item.nodeid.split("::", 1)[0]
        cost[path] = cost.get(path, 0.0) + s
    rank = {path: i for i, path in enumerate(sorted(cost, key=lambda p: -cost[p]))}
    return sorted(items, key=lambda item: rank[item.nodeid.split("::", 1)[0]])
