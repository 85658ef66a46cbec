"""A Hugging Face Qwen3-MoE checkpoint end to end through the commands (docs/DESIGN.md §11).

One tiny local model directory (tests/hf_fixtures.py: a byte-level BPE tokenizer with a chat
template, `<|im_end|>` and `<|endoftext|>`, no BOS; a random Qwen3-MoE split over several
safetensors shards) and a GSM8K-style jsonl with one row lacking its answer and one prompt longer
than the prefill. Then:
- `python -m rollout_server --config ...` (server.wait_for_weights=false, so it samples with the
  checkpoint's own weights): Pull returns prompt_ids equal to the chat template's ids, completions
  that end at their first stop id (finish EOS) or at max_new_tokens, completion_text equal to
  decode(completion_ids, skip_special_tokens=True), and behavior log-probs equal to transformers'
  log-softmax of the same tokens (over the tokenizer's ids, temperature 1) within 1e-3; Stats
  counts the skipped row and the skipped prompt.
- `python -m train --config ...` runs a few steps from the checkpoint's weights, against a local
  server child that serves them in bfloat16 (server.dtype) while the trainer's master weights are
  float32.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest
import yaml

from rollout_api.proto import rollout_pb2
from sat_jax.experiment import load_config
from sat_jax.model import hf
from tests import hf_fixtures
from tests.rollout_server.conftest import unpacked

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 12
LOGP_ATOL = 1e-3
# Stop ids besides the checkpoint's eos set: the tokens this random model samples most, so that
# completions do end on a stop id (the eos tokens alone have probability ~1/400 here).
N_EXTRA_STOPS = 24


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return env


def _frequent_tokens(d: hf_fixtures.HFDir, prompts: list[list[int]], n: int) -> list[int]:
    """The `n` ids of highest mean next-token probability after the prompts."""
    size = len(d.tokenizer)
    total = torch.zeros(size)
    with torch.no_grad():
        for ids in prompts:
            logits = d.model(torch.tensor([ids])).logits[0, :, :size]
            total += torch.softmax(logits, -1).mean(0)
    return [int(i) for i in total.topk(n).indices]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_e2e")
    d = hf_fixtures.make_hf_dir(root, problems=8)
    with open(d.data, "a") as f:
        f.write(json.dumps({"question": "A row without its answer."}) + "\n")
        f.write(json.dumps({"question": "apples and pens " * 30, "answer": "#### 1"}) + "\n")
    template = {
        row["question"]: list(
            d.tokenizer.apply_chat_template(
                [{"role": "user", "content": row["question"]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for row in hf_fixtures.gsm8k_rows(8)
    }
    frequent = _frequent_tokens(d, list(template.values()), N_EXTRA_STOPS)
    stops = sorted(set(frequent) - set(d.eos_ids))
    config = {
        "name": "hf_e2e",
        "model": {"hf_path": str(d.path), "max_seq_len": 128},
        "task": {
            "source": "file",
            "path": str(d.data),
            "prompt_key": "question",
            "answer_key": "answer",
            "chat_template": True,
            "reward": "gsm8k",
        },
        "server": {"max_prefill_length": 64, "slots": 4},
        "rollout": {
            "group_size": 2,
            "batch_groups": 2,
            "max_staleness": 4,
            "max_new_tokens": MAX_NEW_TOKENS,
            "stop_token_ids": stops,
        },
        "train": {"client": {"pull_timeout_s": 5.0, "wait_s": 300.0}},
    }
    path = root / "hf_e2e.yaml"
    path.write_text(yaml.safe_dump(config))
    return d, path, template, {*d.eos_ids, *stops}


class _Server:
    """`python -m rollout_server --config CFG ...` on a free port, sampling with the checkpoint's
    own weights (no trainer); stopped with SIGINT (at once; SIGTERM would drain first)."""

    def __init__(self, config: pathlib.Path, tmp: pathlib.Path, *overrides: str):
        self.port = portpicker.pick_unused_port()
        self.log_path = tmp / "server.log"
        cmd = [sys.executable, "-m", "rollout_server", "--config", str(config),
               f"server.port={self.port}", "server.wait_for_weights=false",
               f"server.state_dir={tmp / 'state'}", *overrides]  # fmt: skip
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, cwd=tmp, env=_env(), stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving on" not in self.log():
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"server not ready:\n{self.log()}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _pull_groups(server: _Server, want: int) -> tuple[list, rollout_pb2.StatsResponse]:
    from rollout_api.client import connect

    cfg = load_config(None, [])
    channel, stub = connect(f"127.0.0.1:{server.port}", cfg.server.max_message_bytes)
    try:
        groups: list = []
        deadline = time.monotonic() + 400
        while len(groups) < want and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log()
            request = rollout_pb2.PullRequest(max_groups=want, timeout_s=10, include_texts=True)
            reply = stub.Pull(request, timeout=30)
            groups += unpacked(reply.groups)
        stats = stub.Stats(rollout_pb2.StatsRequest(), timeout=10)
    finally:
        channel.close()
    assert len(groups) >= want, f"only {len(groups)} groups:\n{server.log()}"
    return groups, stats


def test_serve_pull_matches_the_template_and_transformers_logprobs(setup, tmp_path):
    d, config, template, stops = setup
    server = _Server(config, tmp_path)
    try:
        server.wait_ready(timeout_s=400)
        # Every good prompt is dispatched (10 groups admitted), so the long one is drawn too.
        groups, stats = _pull_groups(server, 8)
    finally:
        server.stop()
    # The long prompt is drawn at least once (every 9 draws); each draw is skipped and counted.
    assert stats.rows_skipped == 1 and stats.prompts_skipped >= 1, stats
    log = (tmp_path / "server.log").read_text()
    assert "skipped 1 of 10 rows (1 without 'answer')" in log
    assert "reward failed" not in log and "Traceback" not in log, log
    size = len(d.tokenizer)
    finishes = []
    for g in groups:
        want_prompt = template[g.prompt_text]
        for t in g.trajectories:
            prompt, completion = list(t.prompt_ids), list(t.completion_ids)
            assert prompt == want_prompt
            assert all(0 <= i < size for i in completion)  # padding rows are never sampled
            assert not stops & set(completion[:-1])
            if t.finish_reason == rollout_pb2.FINISH_REASON_EOS:
                assert completion[-1] in stops
            else:
                assert t.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
                assert len(completion) == MAX_NEW_TOKENS
            finishes.append(t.finish_reason)
            assert t.completion_text == d.tokenizer.decode(completion, skip_special_tokens=True)
            with torch.no_grad():
                logits = d.model(torch.tensor([prompt + completion])).logits[0, :, :size]
            logp = torch.log_softmax(logits.double(), -1)[len(prompt) - 1 : -1]
            want = logp[torch.arange(len(completion)), torch.tensor(completion)].numpy()
            np.testing.assert_allclose(t.behavior_logprobs, want, atol=LOGP_ATOL, rtol=0)
    assert rollout_pb2.FINISH_REASON_EOS in finishes


def test_train_runs_from_the_checkpoint_with_bfloat16_serving(setup, tmp_path):
    """Then sat-export of the trained run loads in transformers (weights moved, logits equal
    ours within 1e-4, same tokenizer) and sat-eval prints avg@K and pass@K."""
    d, config, template, _ = setup
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--config", str(config), "train.steps=2",
           "server.dtype=bfloat16", f"train.run_dir={run_dir}",
           # Random weights earn reward 0, so GRPO's gradient is 0: weight decay still moves
           # every weight, which the export below must show.
           "train.optimizer.weight_decay=0.1"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + (run_dir / "server.log").read_text()
    assert "done: 2 steps" in out, out
    assert "loaded " in out and "supervised warm-up" not in out
    records = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").open()]
    steps = [r for r in records if "lag_max" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # bfloat16 serving vs float32 training: the behavior/trainer log-prob gap is bfloat16
    # rounding, far from the gap of unrelated weights (which is O(1) nats here).
    assert all(r["mismatch_abs_mean"] < 0.1 for r in steps), steps

    def command(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", *args, "--config", str(config), f"train.run_dir={run_dir}"]
        return subprocess.run(
            cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
        )

    export_dir = tmp_path / "export"
    proc = command("train.export", "--out", str(export_dir), "train.optimizer.weight_decay=0.1")
    assert proc.returncode == 0, proc.stderr
    trained = transformers.AutoModelForCausalLM.from_pretrained(export_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert tok("Tom has 3 apples")["input_ids"] == d.tokenizer("Tom has 3 apples")["input_ids"]
    base, moved = d.model.state_dict(), trained.state_dict()
    assert any(not torch.equal(moved[k], base[k]) for k in base), "training changed no weight"
    ids = next(iter(template.values()))
    with torch.no_grad():
        want = trained(torch.tensor([ids])).logits.numpy()
    ours = hf.load_qwen3_moe(export_dir)
    got = np.asarray(ours(np.asarray([ids], np.int32)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    proc = command(
        "train.eval_checkpoint", "--k", "2", "--problems", "4", "train.optimizer.weight_decay=0.1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "avg@2" in proc.stdout and "pass@2" in proc.stdout, proc.stdout


def _truncated_logsoftmax(logits, top_k: int, top_p: float):
    """float64 log-probs of top-k then top-p (the smallest prefix whose mass reaches top_p)
    renormalised, −inf outside; and each row's kept-set size."""
    x = logits.double()
    kth = x.topk(top_k, dim=-1).values[:, -1:]
    x = x.masked_fill(x < kth, -torch.inf)
    sorted_x, _ = x.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_x, -1)
    before = probs.cumsum(-1) - probs
    cut = torch.where(before < top_p, sorted_x, torch.inf).min(-1, keepdim=True).values
    x = x.masked_fill(x < cut, -torch.inf)
    return torch.log_softmax(x, -1), torch.isfinite(x).sum(-1)


def test_truncated_sampling_matches_transformers_and_the_trainer_replays_it(setup, tmp_path):
    """top_p = 0.9, top_k = 20: behavior log-probs are transformers' truncated, renormalised
    log-softmax and each token's kept count its kept-set size; the trainer at lag 0 (the
    checkpoint's weights, float32) scores them with sampler_kl ≈ 0 under the replay and > 0
    over the whole vocabulary."""
    import jax

    from rollout_api.records import decode_pulled
    from sat_jax import sharding
    from sat_jax.step import create_train_state, shard_batch
    from train import batching
    from train import main as train_main
    from train import setup as train_setup

    d, config, _, _ = setup
    overrides = ["rollout.top_p=0.9", "rollout.top_k=20"]
    server = _Server(config, tmp_path, *overrides)
    try:
        server.wait_ready(timeout_s=400)
        groups, _ = _pull_groups(server, 4)
    finally:
        server.stop()
    size = len(d.tokenizer)
    for g in groups:
        for t in g.trajectories:
            prompt, completion = list(t.prompt_ids), list(t.completion_ids)
            with torch.no_grad():
                logits = d.model(torch.tensor([prompt + completion])).logits[0, :, :size]
            logp, kept = _truncated_logsoftmax(logits[len(prompt) - 1 : -1], 20, 0.9)
            want = logp[torch.arange(len(completion)), torch.tensor(completion)].numpy()
            np.testing.assert_allclose(t.behavior_logprobs, want, atol=LOGP_ATOL, rtol=0)
            assert list(t.kept_counts) == kept.tolist()

    metrics = {}
    for replay in ("truncated", "full"):
        cfg = load_config(str(config), [*overrides, f"rollout.logprob_replay={replay}"])
        spec = train_setup.batch_spec(cfg)
        pulled = decode_pulled(groups[:2], spec.limits)
        selection = batching.select_groups(pulled, spec, trainer_version=0, min_version=0)
        batch, _ = batching.assemble_batch(selection, spec, trainer_version=0)
        assert (batch.kept_counts is not None) == (replay == "truncated")
        mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
        _, params = hf.load_params(cfg.model.hf_path, cfg.model)
        optimizer = cfg.train.optimizer.make(cfg.train.steps)
        state = create_train_state(cfg.model, optimizer, mesh, params)
        step = train_main.make_step_fn(cfg, optimizer, mesh)
        _, m = step(state, shard_batch(batch, mesh))
        metrics[replay] = jax.device_get(m)
    assert metrics["truncated"]["sampler_kl"] < 1e-5, metrics["truncated"]
    assert metrics["full"]["sampler_kl"] > 1e-3, metrics["full"]
    assert metrics["full"]["mismatch_abs_mean"] > 10 * metrics["truncated"]["mismatch_abs_mean"]


def test_the_dapo_config_runs_and_its_filter_never_stalls(setup, tmp_path):
    """configs/dapo_sat_gsm8k.yaml on the checkpoint: random weights earn reward 0 on every
    sample, so every group is all-equal; the filter spends its budget, says so, fills the batch
    unfiltered, and the run finishes its steps (soft overlong shaping and SAT on)."""
    d, _, _, _ = setup
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--config", str(REPO / "configs/dapo_sat_gsm8k.yaml"),
           f"model.hf_path={d.path}", f"task.path={d.data}", "train.steps=2",
           f"train.run_dir={run_dir}", "train.eval.problems=0", "rollout.batch_groups=2",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "train.overlong_cache=4",
           "train.filter_max_rounds=1", "server.max_prefill_length=64", "model.max_seq_len=128",
           "train.client.wait_s=300"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + (run_dir / "server.log").read_text()
    assert "done: 2 steps" in out, out
    assert "filled without the filter" in out, out
    steps = [
        r for r in map(json.loads, (run_dir / "logs" / "metrics.jsonl").open()) if "lag_max" in r
    ]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["groups_filtered"] == 2 for r in steps), steps  # the budget: 1 x 2 groups
    assert all(0 <= r["overlong_frac"] <= 1 and "sampler_kl" in r for r in steps), steps


def test_lora_trains_serves_and_exports_merged_and_as_a_peft_adapter(setup, tmp_path):
    """LoRA on the checkpoint: sat-train pushes only the adapters to a bfloat16 server that
    serves their merge; sat-export's merged checkpoint keeps every non-target tensor (norms,
    embeddings, router) bit for bit and changes the targets; `--adapter` loads with peft onto the
    original checkpoint with the merged export's logits; sat-eval reads the LoRA run."""
    peft = pytest.importorskip("peft")
    d, config, template, _ = setup
    run_dir = tmp_path / "run"
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[attention,experts]"]
    # Random weights earn reward 0; DAPO's soft overlong penalty makes the rewards of a group
    # differ (by completion length), so the adapters get a gradient.
    shaping = ["train.overlong=soft", "train.overlong_cache=10", "train.overlong_penalty=1.0",
               "train.optimizer.learning_rate=1e-2"]  # fmt: skip
    common = [*lora, *shaping, f"train.run_dir={run_dir}"]
    # Synchronous: every step's tokens come from the adapters just pushed, so the behavior/trainer
    # gap is bfloat16 rounding only if the server serves exactly base + scale·A·B.
    cmd = [sys.executable, "-m", "train", "--config", str(config), "train.steps=3",
           "server.dtype=bfloat16", "train.mode=sync", "rollout.max_staleness=0",
           *common]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + (run_dir / "server.log").read_text()
    assert "done: 3 steps" in out and "LoRA base written to" in out, out
    steps = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").open()]
    steps = [r for r in steps if "lag_max" in r]
    assert all(r["lag_max"] == 0 and r["mismatch_abs_mean"] < 0.02 for r in steps), [
        (r["lag_max"], r["mismatch_abs_mean"]) for r in steps
    ]
    cfg = load_config(str(config), common)
    base_bytes = 2 * sum(int(np.prod(t.shape)) for t in d.model.state_dict().values())
    pushed = [r["push_bytes"] for r in steps if r.get("push_bytes")]
    assert pushed and all(0 < b < base_bytes / 5 for b in pushed), (pushed, base_bytes)
    assert cfg.model.lora.rank == 4

    def command(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", *args, "--config", str(config), *common]
        return subprocess.run(
            cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
        )

    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    proc = command("train.export", "--out", str(merged_dir))
    assert proc.returncode == 0, proc.stderr
    original, merged = hf.read_checkpoint(d.path), hf.read_checkpoint(merged_dir)
    assert sorted(original) == sorted(merged)
    targets = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.",
               "self_attn.o_proj.", "mlp.experts.")  # fmt: skip
    changed = {k for k in original if not np.array_equal(original[k], merged[k])}
    assert changed and all(any(t in k for t in targets) for k in changed), sorted(changed)
    assert any("mlp.experts." in k for k in changed) and any("q_proj" in k for k in changed)
    assert any("mlp.gate." in k for k in original)  # the router: present and bit-identical
    proc = command("train.export", "--out", str(adapter_dir), "--adapter")
    assert proc.returncode == 0, proc.stderr
    ids = next(iter(template.values()))
    logits = lambda m: m(torch.tensor([ids])).logits.detach().float().numpy()
    with torch.no_grad():
        want = logits(transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval())
        base = transformers.AutoModelForCausalLM.from_pretrained(d.path).eval()
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        np.testing.assert_allclose(logits(adapted), want, atol=1e-4, rtol=1e-4)
    proc = command("train.eval_checkpoint", "--k", "2", "--problems", "4")
    assert proc.returncode == 0, proc.stderr
    assert "avg@2" in proc.stdout and "pass@2" in proc.stdout, proc.stdout


def test_multi_turn_episodes_match_transformers_and_sat_train_runs_them(setup, tmp_path):
    """`task.env=feedback` on the checkpoint: the server runs episodes of up to 3 turns. Every
    inserted run decodes to the chat template's delta of the environment's message (after the
    template's end-of-turn token when a turn ended otherwise), every generated token's behavior
    log-prob equals transformers' over the whole multi-turn sequence, the trainer at lag 0 with
    R3 routes the inserted tokens as the server recorded and scores the generated ones as the
    server did (``_check_multi_turn_routing_replay``), and sat-train trains on them."""
    d, config, _, stops = setup
    env = ["task.env=feedback", "task.max_turns=3", "task.max_episode_tokens=64"]
    server = _Server(config, tmp_path, *env)
    try:
        server.wait_ready(timeout_s=400)
        groups, stats = _pull_groups(server, 2)
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()
    # Inserted tokens are computed once each, by the cache extension; prompts once per group.
    pulled = sum(
        int(np.sum(~np.asarray(t.loss_mask, bool))) for g in groups for t in g.trajectories
    )
    assert stats.inserted_tokens >= pulled > 0, (stats.inserted_tokens, pulled)
    assert stats.prefill_tokens >= sum(len(g.trajectories[0].prompt_ids) for g in groups)
    delta = d.tokenizer.apply_chat_template(
        [{"role": "user", "content": "That is not correct. Try again."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    size, end = len(d.tokenizer), d.tokenizer.convert_tokens_to_ids("<|im_end|>")
    inserted_runs = 0
    for g in groups:
        for t in g.trajectories:
            prompt, completion = list(t.prompt_ids), list(t.completion_ids)
            mask = np.asarray(t.loss_mask, bool)
            assert mask.size == len(completion) <= 64 and mask[0]
            bounds = np.flatnonzero(np.diff(np.concatenate([[1], mask, [1]]).astype(int)))
            turn_start = 0
            for start, stop in zip(bounds[::2], bounds[1::2], strict=True):
                inserted_runs += 1
                text = d.tokenizer.decode(completion[start:stop])
                before = completion[start - 1]  # the turn's last generated token
                closed = before == end
                assert text == ("\n" if closed else "<|im_end|>\n") + delta, (text, before)
                # A turn closed by the inserted <|im_end|> ended on another stop id or was cut.
                assert closed or before in stops or start - turn_start == MAX_NEW_TOKENS
                turn_start = stop
            with torch.no_grad():
                logits = d.model(torch.tensor([prompt + completion])).logits[0, :, :size]
            logp = torch.log_softmax(logits.double(), -1)[len(prompt) - 1 : -1]
            want = logp[torch.arange(len(completion)), torch.tensor(completion)].numpy()
            np.testing.assert_allclose(
                np.asarray(t.behavior_logprobs)[mask], want[mask], atol=LOGP_ATOL, rtol=0
            )
    assert inserted_runs > 0  # random weights answer wrong: the environment asked again
    _check_multi_turn_routing_replay(d, config, env, groups)

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--config", str(config), "train.steps=2", *env,
           f"train.run_dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + (run_dir / "server.log").read_text()
    assert "done: 2 steps" in out, out
    steps = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").open()]
    steps = [r for r in steps if "lag_max" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in steps), steps


def _check_multi_turn_routing_replay(d, config, env, groups) -> None:
    """R3 at lag 0 on the pulled episodes (the checkpoint's weights, float32, as served): the
    trainer's own routing of every inserted token is the routing the server's cache extension
    recorded; replaying the recorded routing of every position, the trainer's log-probs of the
    generated tokens after an observation equal the behavior log-probs as tightly as those of
    the first turn (a single-turn completion's), and the train step's sampler_kl is ~0."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from rollout_api.records import decode_pulled
    from rollout_api.routing_codec import decode_routing
    from sat_jax import sharding
    from sat_jax.step import create_train_state, shard_batch
    from train import batching
    from train import main as train_main
    from train import setup as train_setup

    cfg = load_config(str(config), env)
    graphdef, params = hf.load_params(cfg.model.hf_path, cfg.model)
    model = nnx.merge(graphdef, params)
    vocab = jnp.arange(cfg.model.vocab_size) < len(d.tokenizer)
    first_turn, later_turns, compared = [], [], 0
    for g in groups:
        for t in g.trajectories:
            p, mask = len(t.prompt_ids), np.asarray(t.loss_mask, bool)
            seq = jnp.asarray([[*t.prompt_ids, *t.completion_ids]], jnp.int32)
            recorded = decode_routing(t.routing).astype(np.int32)
            live = np.asarray(model.forward(seq).routing_btlk[0])
            inserted = p + np.flatnonzero(~mask)
            np.testing.assert_array_equal(
                np.sort(recorded[inserted], -1), np.sort(live[inserted], -1)
            )
            compared += inserted.size
            logp = model.logprobs(seq, vocab_mask=vocab, replay_routing=jnp.asarray(recorded)[None])
            err = np.abs(np.asarray(logp[0])[0, p:] - np.asarray(t.behavior_logprobs))
            first_obs = int(np.argmin(mask)) if not mask.all() else mask.size
            first_turn += list(err[:first_obs])
            later_turns += list(err[first_obs:][mask[first_obs:]])
    assert compared > 0 and later_turns
    print(f"R3 at lag 0: {compared} inserted tokens routed as recorded; max |logp - behavior| "
          f"first turn {max(first_turn):.2e}, after an observation {max(later_turns):.2e}")  # fmt: skip
    assert max(later_turns) <= max(2 * max(first_turn), 1e-5), (first_turn, later_turns)

    spec = train_setup.batch_spec(cfg)
    selection = batching.select_groups(
        decode_pulled(groups[: cfg.rollout.batch_groups], spec.limits),
        spec,
        trainer_version=0,
        min_version=0,
    )
    batch, _ = batching.assemble_batch(selection, spec, trainer_version=0)
    mesh = sharding.make_mesh(sharding.MeshConfig(fsdp=1), jax.devices()[:1])
    optimizer = cfg.train.optimizer.make(cfg.train.steps)
    state = create_train_state(cfg.model, optimizer, mesh, params)
    _, m = train_main.make_step_fn(cfg, optimizer, mesh)(state, shard_batch(batch, mesh))
    m = jax.device_get(m)
    print(f"train step at lag 0: sampler_kl {float(m['sampler_kl']):.2e} over "
          f"{int(m['fresh_tokens'])} tokens, mismatch_abs_mean "
          f"{float(m['mismatch_abs_mean']):.2e}")  # fmt: skip
    assert m["fresh_tokens"] > 0 and m["sampler_kl"] < 1e-5, m
    assert m["mismatch_abs_mean"] <= max(2 * max(first_turn), 1e-5), m


def test_the_calculator_config_runs(setup, tmp_path):
    """configs/calculator_gsm8k.yaml on the checkpoint (sizes cut to the tiny model): the
    server renders the calculator tool into every prompt and runs calculator episodes, and
    sat-train finishes its step."""
    d, _, _, _ = setup
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--config", str(REPO / "configs/calculator_gsm8k.yaml"),
           f"model.hf_path={d.path}", f"task.path={d.data}", "train.steps=1",
           f"train.run_dir={run_dir}", "train.eval.problems=0", "rollout.batch_groups=2",
           "rollout.group_size=2", "rollout.max_new_tokens=8", "task.max_episode_tokens=24",
           "server.max_prefill_length=128", "model.max_seq_len=256",
           "train.client.wait_s=300"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=800
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out + (run_dir / "server.log").read_text()
    assert "done: 1 steps" in out, out
    assert "Traceback" not in (run_dir / "server.log").read_text()
