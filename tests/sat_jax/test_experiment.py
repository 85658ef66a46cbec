"""sat_jax.experiment: defaults only in dataclasses, YAML + dotted overrides, errors name the key."""

import dataclasses
import functools
import json
import pathlib
import re

import jax.numpy as jnp
import pytest

from sat_jax.config import (
    CheckpointConfig,
    ClientConfig,
    Connection,
    EvalConfig,
    TrainConfig,
    WarmupConfig,
    read_overrides,
)
from sat_jax.experiment import MOVED_KEYS, ConfigError, ExperimentConfig, load_config
from sat_jax.model import PRESETS, LoRAConfig
from sat_jax.model.config import runtime_overrides
from sat_jax.model.make_tiny import make_tiny
from sat_jax.optimizer import OptimizerConfig
from train import setup


def test_defaults_without_file():
    assert load_config(None, []) == ExperimentConfig()


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\nrollout:\n  group_size: 8\n  temperature: 0.7\nserver:\n  port: 1\n")
    cfg = load_config(str(path), ["server.port=1234", "rollout.top_k=5", "task.operators=+-*"])
    assert cfg.name == "x"
    assert cfg.rollout.group_size == 8 and cfg.rollout.temperature == 0.7
    assert cfg.rollout.top_k == 5
    assert cfg.server.port == 1234
    assert cfg.task.operators == "+-*"


def test_model_preset_and_field_override():
    cfg = load_config(
        None, ["model.preset=small", "model.num_layers=2", "model.mlp_only_layers=[0]"]
    )
    assert cfg.model == PRESETS["small"].replace(num_layers=2, mlp_only_layers=(0,))


def test_lora_keys_parse_into_the_model_lora_config(tmp_path):
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.targets=[attention,experts,router]"])
    assert cfg.model.lora == LoRAConfig(rank=8, targets=("attention", "experts", "router"))
    assert cfg.model.lora.scale == 2.0
    path = tmp_path / "lora.yaml"
    path.write_text("model:\n  lora:\n    rank: 4\n    alpha: 8\n")
    assert load_config(str(path)).model.lora == LoRAConfig(rank=4, alpha=8.0)
    assert load_config(None, []).model.lora.rank == 0


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.lora.rank=-1", r"^model\.lora: lora\.rank must be an int >= 0"),
        ("model.lora.rank=2.5", r"^model\.lora\.rank: expected int"),
        ("model.lora.alpha=0", r"^model\.lora: lora\.alpha must be a positive"),
        ("model.lora.targets=[attention,mlpp]", r"^model\.lora: .*unknown target 'mlpp'"),
        ("model.lora.targets=[shared_expert]", r"^model\.lora: .*Qwen3-MoE has no shared expert"),
        ("model.lora.nope=1", r"^model\.lora\.nope: unknown key"),
        ("model.lora=8", r"^model\.lora: expected a mapping"),
    ],
)
def test_bad_lora_keys_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_int_accepted_for_float():
    assert load_config(None, ["rollout.temperature=1"]).rollout.temperature == 1.0


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.nope=1", "rollout.nope"),
        ("nope=1", "nope"),
        ("rollout.group_size=abc", "rollout.group_size"),
        ("rollout.group_size=0", "rollout"),
        ("rollout.group_size=true", "rollout.group_size"),
        ("rollout.temperature=-1", "rollout"),
        ("model.preset=huge", "model.preset"),
        ("model.num_heads=3", "model"),
        ("server.max_prefill_length=20", "server"),
        ("server.host=0.0.0.0", "server"),
        ("rollout=3", "rollout"),
        ("model.mlp_only_layers=[a]", "model.mlp_only_layers[0]"),
    ],
)
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key.replace('[', '.').replace(']', '.')}"):
        load_config(None, [override])


def test_cross_section_check():
    with pytest.raises(ConfigError, match="max_seq_len"):
        load_config(None, ["rollout.max_new_tokens=200"])


@pytest.mark.parametrize(
    "correction",
    [
        None,
        "train.loss.tis_cap=2.0",
        "train.loss.icepop_range=[0.5,2.0]",
        "train.loss.seq_tis_cap=2.0",
        "train.loss.seq_mask_range=[0.5,2.0]",
    ],
)
def test_recompute_needs_a_rollout_correction(correction):
    """Without a correction `recompute` would be unweighted, unclipped REINFORCE on stale data."""
    overrides = ["train.old_logp=recompute", "train.loss.sat.enabled=false"]
    if correction is None:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        message = str(err.value)
        assert "\n" not in message
        for key in ("tis_cap", "icepop_range", "seq_tis_cap", "seq_mask_range"):
            assert f"loss.{key}" in message
        return
    assert load_config(None, [*overrides, correction]).train.old_logp == "recompute"


def test_not_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rollout.group_size"])


def test_non_loopback_with_token_ok():
    cfg = load_config(None, ["server.host=0.0.0.0", "server.token=s3cret"])
    assert cfg.server.host == "0.0.0.0"


def test_frozen():
    with pytest.raises(AttributeError):
        ExperimentConfig().name = "y"  # type: ignore[misc]


def test_tls_needs_cert_and_key():
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        load_config(None, ["server.tls_cert=/x.pem"])


CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def test_shipped_configs_load():
    cfg = load_config(str(CONFIGS / "arith_tiny.yaml"), [])
    assert cfg.name == "arith_tiny" and cfg.model == PRESETS["tiny"]
    main = load_config(str(CONFIGS / "arith_main.yaml"), [])
    assert main.name == "arith_main" and main.model == PRESETS["tiny"]
    # The main job's shapes live in its config, not on a command line.
    assert (main.rollout.group_size, main.rollout.batch_groups, main.server.slots) == (8, 16, 32)
    assert main.train.warmup.steps > 0 and main.train.warmup.cache_dir == "runs/sft_cache"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_hold_only_overrides(path):
    # Every key of a shipped config changes a default (of the dataclasses or the model preset).
    flat = read_overrides(str(path))
    preset = flat.get("model.preset")
    assert preset != "tiny", f"{path.name}: model.preset repeats its default 'tiny'"
    # Model fields default to the chosen preset's.
    defaults = load_config(None, [f"model.preset={preset}"] if preset else [])
    for key, value in flat.items():
        if key == "model.preset":
            continue
        default = functools.reduce(getattr, key.split("."), defaults)
        assert value != default, f"{path.name}: {key} repeats its default {default!r}"


def test_the_vocabulary_must_hold_the_tokenizers_ids():
    # 17 characters + pad, bos, eos = 20 ids.
    assert load_config(None, ["model.vocab_size=20"]).model.vocab_size == 20
    with pytest.raises(ConfigError, match="needs 20 token ids, model.vocab_size is 19"):
        load_config(None, ["model.vocab_size=19"])


@pytest.mark.parametrize("text,value", [("5e-4", 5e-4), ("1E3", 1000.0), ("2.5e+1", 25.0)])
def test_exponent_floats_without_a_dot_parse(text, value):
    cfg = load_config(None, [f"train.optimizer.learning_rate={text}"])
    assert cfg.train.optimizer.learning_rate == value


@pytest.mark.parametrize("text", ["fast", "1e", "e5", "1.2.3"])
def test_non_floats_are_rejected_naming_the_key(text):
    with pytest.raises(ConfigError, match="train.optimizer.learning_rate"):
        load_config(None, [f"train.optimizer.learning_rate={text}"])


def test_unreadable_or_malformed_file_is_one_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML") as err:
        load_config(str(bad))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the config"):
        load_config(str(tmp_path / "missing.yaml"))


# A Qwen3-MoE config.json (the loader reads only this file).
HF_CONFIG = dict(
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


@pytest.fixture
def hf_dir(tmp_path):
    # The loader checks that tokenizer files exist; it does not load them.
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    return tmp_path


def test_hf_tokenizer_files_are_checked_naming_the_key(hf_dir, tmp_path_factory):
    bare = tmp_path_factory.mktemp("bare")
    with pytest.raises(ConfigError, match=r"^task\.tokenizer_path: no tokenizer files in .*bare"):
        load_config(None, [f"model.hf_path={hf_dir}", f"task.tokenizer_path={bare}"])
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"^model\.hf_path: no tokenizer files in"):
        load_config(None, [f"model.hf_path={hf_dir}"])
    (bare / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^task\.chat_template: the tokenizer in .* has no chat"):
        load_config(
            None,
            [f"model.hf_path={hf_dir}", f"task.tokenizer_path={bare}", "task.chat_template=true"],
        )
    cfg = load_config(None, [f"model.hf_path={hf_dir}", f"task.tokenizer_path={bare}"])
    assert cfg.tokenizer_path == str(bare)
    with pytest.raises(ConfigError, match=r"^ExperimentConfig: train\.warmup\.steps: "):
        load_config(
            None,
            [f"model.hf_path={hf_dir}", f"task.tokenizer_path={bare}", "train.warmup.steps=5"],
        )


def test_hf_path_takes_the_architecture_from_config_json(hf_dir):
    cfg = load_config(None, [f"model.hf_path={hf_dir}", "model.dtype=bfloat16"])
    m = cfg.model
    assert (m.vocab_size, m.d_model, m.num_experts, m.head_dim) == (96, 32, 4, 8)
    assert m.hf_path == str(hf_dir) and m.dtype == "bfloat16" and m.max_seq_len == 256
    # The tokenizer defaults to the checkpoint's.
    assert cfg.tokenizer_kind == "hf" and cfg.tokenizer_path == str(hf_dir)
    # Runtime choices may be set; repeating config.json's value is no contradiction.
    cfg = load_config(
        None, [f"model.hf_path={hf_dir}", "model.max_seq_len=128", "model.d_model=32"]
    )
    assert cfg.model.max_seq_len == 128
    assert load_config(None, [f"model.hf_path={hf_dir}", "task.tokenizer=char"]).tokenizer_kind == (
        "char"
    )


def test_lora_may_be_set_beside_hf_path(hf_dir):
    cfg = load_config(
        None, [f"model.hf_path={hf_dir}", "model.lora.rank=4", "model.lora.targets=[attention]"]
    )
    assert cfg.model.lora == LoRAConfig(rank=4, targets=("attention",))
    assert cfg.model.hf_path == str(hf_dir) and cfg.model.num_experts == 4
    # What a loader passes `hf.load_qwen3_moe` rebuilds the same config.
    assert runtime_overrides(cfg.model)["lora"] == cfg.model.lora


def test_defaults_keep_the_char_tokenizer():
    cfg = load_config(None, [])
    assert cfg.tokenizer_kind == "char" and cfg.tokenizer_path == ""
    assert cfg.serving_model == cfg.model


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.num_experts=8"], r"^model\.num_experts: 8 contradicts .*config\.json \(4\)"),
        (["model.preset=small"], r"^model\.preset: cannot be combined with model\.hf_path"),
    ],
)
def test_hf_path_overrides_that_contradict_it(hf_dir, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"model.hf_path={hf_dir}", *overrides])


def test_hf_path_bad_checkpoints(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.hf_path: no config\.json in"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"^model\.hf_path: .*'llama', expected 'qwen3_moe'"):
        load_config(None, [f"model.hf_path={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(
        ConfigError, match=r"^model\.hf_path: .*config\.json (has neither rope_theta|lacks)"
    ):
        load_config(None, [f"model.hf_path={tmp_path}"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["task.tokenizer=bpe"], r"^task: tokenizer must be 'char' or 'hf'"),
        (["task.system_prompt=hi"], r"^task: system_prompt needs chat_template"),
        (["task.chat_template=true"], r"task\.chat_template needs task\.tokenizer 'hf'"),
        (["task.tokenizer=hf"], r"task\.tokenizer 'hf' needs task\.tokenizer_path"),
        (["task.reward=nope"], r"^task: reward must be one of"),
        (["server.dtype=int8"], r"^server: dtype must be a floating dtype"),
        (["server.dtype=float33"], r"^server: dtype 'float33' is not a dtype"),
        (["rollout.stop_token_ids=[-1]"], r"^rollout: stop_token_ids must be >= 0"),
        (["rollout.stop_token_ids=[64]"], r"rollout\.stop_token_ids: 64 is outside"),
    ],
)
def test_tokenizer_and_precision_keys_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_tokenizer_and_precision_keys(hf_dir):
    cfg = load_config(
        None,
        [
            "task.tokenizer=hf",
            f"task.tokenizer_path={hf_dir}",
            "task.chat_template=true",
            "task.system_prompt=Be brief.",
            "task.reward=gsm8k",
            "rollout.stop_token_ids=[5, 7]",
            "server.dtype=bfloat16",
        ],
    )
    assert cfg.tokenizer_kind == "hf" and cfg.tokenizer_path == str(hf_dir)
    assert cfg.task.chat_template and cfg.task.system_prompt == "Be brief."
    assert cfg.rollout.stop_token_ids == (5, 7) and cfg.task.reward == "gsm8k"
    assert cfg.serving_model.param_dtype == jnp.bfloat16
    assert cfg.model.param_dtype == jnp.float32  # the trainer's master weights


@pytest.mark.parametrize(
    "override, names",
    [
        ("server.lease_s=0", "server: lease_s"),
        ("server.max_request_bytes=1000", "server: max_request_bytes"),
        ("server.max_concurrent_rpcs=0", "server: max_concurrent_rpcs"),
        ("server.max_version_jump=0", "server: max_version_jump"),
    ],
)
def test_hardening_keys_are_checked(override, names):
    with pytest.raises(ConfigError, match=f"^{names}"):
        load_config(None, [override])
    assert load_config(None, ["server.metrics_host=0.0.0.0"]).server.metrics_host == "0.0.0.0"
    assert load_config(None, []).server.metrics_host == "127.0.0.1"


def test_scale_keys_load_and_are_validated() -> None:
    overrides = ["train.microbatches=4", "model.remat=layer"]
    cfg = load_config(None, [*overrides, "train.loss.sat.threshold_scope=microbatch"])
    assert (cfg.train.microbatches, cfg.model.remat) == (4, "layer")
    assert cfg.train.loss.sat.threshold_scope == "microbatch"
    for bad, key in [
        ("train.microbatches=3", "train.microbatches"),
        ("train.loss.sat.threshold_scope=token", "threshold_scope"),
        ("model.remat=full", "remat"),
        ("model.attention=flash", "attention"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


# The parts: sections nested by concept, each the one home of its keys' defaults.
PARTS = {
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "warmup": WarmupConfig,
    "client": ClientConfig,
    "eval": EvalConfig,
}


@pytest.mark.parametrize("name", list(PARTS))
def test_every_part_is_a_nested_section_with_its_own_defaults(name):
    assert isinstance(getattr(TrainConfig(), name), PARTS[name])
    assert getattr(TrainConfig(), name) == PARTS[name]()
    flat_names = {f.name for f in dataclasses.fields(TrainConfig)}
    for field in dataclasses.fields(PARTS[name]):
        # No name-matching copies between sections: a part's field is not also a train key.
        assert field.name not in flat_names - {"loss", "mesh"} or field.name == "steps", field.name


def test_parts_carry_the_configured_keys(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"PEM")
    cfg = load_config(
        None,
        [
            "train.steps=50",
            "train.optimizer.learning_rate=2e-3",
            "train.optimizer.lr_schedule=cosine",
            "train.optimizer.lr_warmup_steps=5",
            "train.optimizer.adam_b2=0.95",
            "train.optimizer.weight_decay=0.1",
            "train.optimizer.grad_clip=0",
            "train.warmup.steps=7",
            "train.warmup.batch=16",
            "train.warmup.learning_rate=1e-3",
            "train.warmup.cache_dir=/cache",
            "train.seed=3",
            "train.checkpoint.dir=gs://b/c",
            "train.checkpoint.every=4",
            "train.checkpoint.keep=2",
            "train.client.servers=[h:1]",
            f"train.tls_ca={ca}",
            "train.client.retry_max_s=2.5",
            "train.client.wait_s=42",
            "train.client.pull_timeout_s=7",
            "train.client.grace_s=3",
            "train.client.servers_file=/etc/servers",
            "train.eval.problems=9",
            "train.eval.every=2",
            "server.token=s3cret",
            "server.max_message_bytes=2097152",
        ],
    )
    assert cfg.train.optimizer == OptimizerConfig(
        learning_rate=2e-3,
        lr_schedule="cosine",
        lr_warmup_steps=5,
        adam_b1=0.9,
        adam_b2=0.95,
        weight_decay=0.1,
        grad_clip=0.0,
    )
    assert cfg.train.warmup == WarmupConfig(
        steps=7, batch=16, learning_rate=1e-3, cache_dir="/cache"
    )
    assert cfg.train.checkpoint == CheckpointConfig(dir="gs://b/c", every=4, keep=2)
    assert cfg.train.eval == EvalConfig(problems=9, every=2)
    assert cfg.train.client == ClientConfig(
        servers=("h:1",),
        servers_file="/etc/servers",
        pull_timeout_s=7.0,
        retry_max_s=2.5,
        wait_s=42.0,
        grace_s=3.0,
    )
    assert setup.connection(cfg) == Connection(
        token="s3cret",
        root_certificates=b"PEM",
        max_message_bytes=2 * 1024 * 1024,
        retry_max_s=2.5,
        server_wait_s=42.0,
        grace_s=3.0,
        servers_file="/etc/servers",
    )


def test_checkpoint_directory_defaults_under_the_run_dir():
    assert CheckpointConfig().directory("runs/x") == "runs/x/checkpoints"
    assert CheckpointConfig(dir="gs://b/c").directory("runs/x") == "gs://b/c"


def test_client_without_a_ca_is_plaintext_and_a_missing_ca_file_is_an_oserror(tmp_path):
    assert setup.connection(ExperimentConfig()).root_certificates is None
    missing = ExperimentConfig(train=TrainConfig(tls_ca=str(tmp_path / "none.pem")))
    with pytest.raises(OSError):
        setup.connection(missing)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.optimizer.lr_schedule=step", "train.optimizer: lr_schedule must be one of"),
        ("train.steps=0", "train: steps must be positive, got 0"),
        ("train.optimizer.lr_warmup_steps=-1", "train.optimizer: lr_warmup_steps must be >= 0"),
        ("train.optimizer.learning_rate=0", "train.optimizer: learning_rate must be > 0"),
        ("train.optimizer.adam_b2=1", r"train.optimizer: adam_b1 and adam_b2 must be in \[0, 1\)"),
        (
            "train.optimizer.grad_clip=-1",
            "train.optimizer: weight_decay and grad_clip must be >= 0",
        ),
        ("train.warmup.steps=-1", "train.warmup: steps must be >= 0"),
        ("train.warmup.batch=0", "train.warmup: batch must be positive"),
        ("train.warmup.learning_rate=0", "train.warmup: learning_rate must be > 0"),
        ("train.checkpoint.every=0", "train.checkpoint: every must be positive"),
        ("train.checkpoint.keep=0", "train.checkpoint: keep must be positive"),
        ("train.client.pull_timeout_s=0", "train.client: pull_timeout_s must be > 0"),
        ("train.client.servers=[nohost]", "train.client: servers: 'nohost' is not host:port"),
        ("train.eval.every=-1", "train.eval: every must be >= 0"),
    ],
)
def test_a_part_checks_its_keys_and_the_error_names_them(override, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(None, [override])


@pytest.mark.parametrize("old, new", sorted(MOVED_KEYS.items()))
def test_a_moved_key_names_its_new_place_on_the_command_line_and_in_yaml(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"^{re.escape(old)}: moved to {re.escape(new)}$"):
        load_config(None, [f"{old}=1"])
    section, _, key = old.partition(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: 1\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(old)}: moved to {re.escape(new)}$"):
        load_config(str(path))
    # The new place is a key that exists (its value may still be checked).
    try:
        load_config(None, [f"{new}=1"])
    except ConfigError as e:
        assert "unknown key" not in str(e) and "moved" not in str(e), e


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """What ``python -m sat_jax.model.make_tiny`` writes: the checkpoint the HF configs name."""
    out = tmp_path_factory.mktemp("hf_tiny")
    make_tiny(out)
    return str(out)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path, tiny_hf_dir):
    # The HF configs name runs/hf_tiny, made by a README command: the same checkpoint stands in.
    overrides = (
        [f"model.hf_path={tiny_hf_dir}"] if "model.hf_path" in read_overrides(str(path)) else []
    )
    cfg = load_config(str(path), overrides)
    assert cfg.name == path.stem


def test_eval_problems_on_a_file_task_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="train.eval.problems: .*task.source is 'file'"):
        load_config(None, ["train.eval.problems=4", "task.source=file", "task.path=p.jsonl"])
    assert load_config(None, ["task.source=file", "task.path=p.jsonl"]).train.eval.problems == 0


def test_a_part_built_by_hand_is_checked_too():
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        dataclasses.replace(TrainConfig().optimizer, learning_rate=0.0)
    with pytest.raises(ValueError, match="keep must be positive"):
        dataclasses.replace(TrainConfig().checkpoint, keep=0)


def test_http_sessions_need_a_chat_template_and_an_http_port():
    with pytest.raises(ConfigError, match="server.http_sessions needs task.chat_template"):
        load_config(None, ["server.http_port=9100", "server.http_sessions=true"])
    with pytest.raises(ConfigError, match="http_sessions needs an http_port"):
        load_config(None, ["server.http_sessions=true"])
