"""RAGEN early stopping: both conditions, triggering and not, and checkpoint round trip."""

import json
import math

from megatron_rl.run.early_stop import EarlyStopper


def test_rv_collapse_triggers():
    es = EarlyStopper()
    for v in [0.4, 0.6] * 5:  # first 10 successful steps -> baseline 0.5, threshold 0.05
        d = es.update_train(v)
        assert not d.stop
    assert es.rv_baseline == 0.5
    es.update_train(0.0, trained=False)  # untrained steps are ignored
    for k in range(9):
        d = es.update_train(0.049)
        assert not d.stop and d.metrics["early_stopped/rv_low_streak"] == k + 1
    d = es.update_train(0.01)
    assert d.stop and d.reason == "reward_variance_collapse"
    assert d.metrics["early_stopped/reward_variance_collapse"] == 1.0
    assert d.metrics["early_stopped/validation_collapse"] == 0.0


def test_rv_streak_resets_and_baseline_window():
    es = EarlyStopper()
    for _ in range(10):
        es.update_train(1.0)
    assert math.isclose(es.rv_baseline, 1.0)
    for _ in range(9):
        assert not es.update_train(0.05).stop
    assert not es.update_train(0.1).stop  # exactly 10% is not below -> reset
    assert es.rv_low_streak == 0
    for _ in range(9):
        assert not es.update_train(0.0).stop
    # not enough baseline steps yet: never stops
    es2 = EarlyStopper()
    for _ in range(9):
        assert not es2.update_train(0.0).stop
    assert math.isnan(es2.metrics()["early_stopped/rv_baseline"])


def test_validation_collapse():
    es = EarlyStopper()
    for s in [0.0, 0.005, 0.0, 0.009]:
        assert not es.update_val(s).stop
    assert not es.update_val(0.01).stop  # 1% is not < 1% -> reset
    for _ in range(4):
        assert not es.update_val(0.0).stop
    d = es.update_val(0.0)
    assert d.stop and d.reason == "validation_collapse"
    assert d.metrics["early_stopped/validation_collapse"] == 1.0


def test_configurable_disabled_and_resume():
    es = EarlyStopper(val_patience=2, val_threshold=0.5)
    es.update_val(0.4)
    state = json.loads(json.dumps(es.state_dict()))
    es2 = EarlyStopper(val_patience=2, val_threshold=0.5)
    es2.load_state_dict(state)
    assert es2.update_val(0.1).stop
    off = EarlyStopper(enabled=False, val_patience=1)
    d = off.update_val(0.0)
    assert not d.stop and d.metrics["early_stopped/val_low_streak"] == 1
