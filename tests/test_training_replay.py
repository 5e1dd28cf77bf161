"""Replay consistency: replaying a run's own policy over its recorded trace reproduces the live
run's scales, and its overflow/underflow counts exactly (power-of-two scales) or within the
histogram's bracket (other scales)."""

import numpy as np
import pytest

from fp8sim.analysis.policy_replay import replay_policies
from fp8sim.policies import parse_policy
from fp8sim.trace import TraceReader
from fp8sim.training import record
from fp8sim.training.model import GPTConfig
from fp8sim.formats import get_format
from fp8sim.recipes import CastConfig, CustomRecipe, LinearRecipe
from fp8sim.scaling_config import parse_scaling
from fp8sim.training.trainer import TrainConfig, Trainer, read_metrics


pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)
MSAMP = "msamp:window=4,margin=0"  # power-of-two scales: the histogram counts are exact


@pytest.fixture(scope="module")
def pow2_recipe():
    scaling = parse_scaling(MSAMP)[0]
    c4, c5 = CastConfig(get_format("e4m3"), scaling), CastConfig(get_format("e5m2"), scaling)
    return CustomRecipe("test-msamp", description="hybrid FP8 with MS-AMP power-of-two scaling",
                        linear=LinearRecipe(c4, c4, c5))


def _run(tmp_path, corpus, recipe, backend="emulator"):
    cfg = TrainConfig(recipe=recipe, backend=backend, steps=8, batch_size=4, warmup=2, eval_every=4,
                      eval_batches=1, checkpoint_every=4, model=TINY, lr=1e-2)
    Trainer(cfg, tmp_path / "run", corpus=corpus,
            recorder_factory=lambda m: record(m, tmp_path / "trace")).run(progress=False)
    return TraceReader(tmp_path / "trace"), read_metrics(tmp_path / "run")


def test_replay_reproduces_live_counts_exactly_with_pow2_policy(tmp_path, stdlib_corpus, pow2_recipe):
    reader, metrics = _run(tmp_path, stdlib_corpus, pow2_recipe)
    recorded, replay = replay_policies(reader, [MSAMP])
    assert recorded.policy == "recorded" and replay.policy == parse_policy(MSAMP).spec
    np.testing.assert_array_equal(replay.cols["scale"], recorded.cols["scale"])
    assert replay.cols["exact"].all()
    for col in ("overflow_lo", "overflow_hi"):
        np.testing.assert_array_equal(replay.cols[col], recorded.cols["overflow_lo"])
    for col in ("underflow_lo", "underflow_hi"):
        np.testing.assert_array_equal(replay.cols[col], recorded.cols["underflow_lo"])
    # and the recorded counts are the live run's (counted on the FP8 codes during training)
    casts = [t.index for t in reader.tensors if t.role != "weight_grad"]
    sel = np.isin(replay.cols["tensor"], casts)
    for row in metrics:
        at = sel & (replay.cols["step"] == row["step"])
        assert replay.cols["underflow_lo"][at].sum() == row["underflow"]
        assert replay.cols["overflow_lo"][at].sum() == row["overflow"]
    assert sum(r["underflow"] for r in metrics) > 0  # the check is not vacuous


def test_replay_of_te_delayed_brackets_live_counts(tmp_path, stdlib_corpus):
    reader, metrics = _run(tmp_path, stdlib_corpus, "te-delayed", backend="torch")
    recorded, replay = replay_policies(reader, ["delayed:history=16,margin=0,algo=max"])
    np.testing.assert_array_equal(replay.cols["scale"], recorded.cols["scale"])
    c, r = replay.cols, recorded.cols
    assert (c["overflow_lo"] <= r["overflow_lo"]).all() and (r["overflow_lo"] <= c["overflow_hi"]).all()
    assert (c["underflow_lo"] <= r["underflow_lo"]).all() and (r["underflow_lo"] <= c["underflow_hi"]).all()
