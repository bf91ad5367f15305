import pytest

from hetserve.policies.predictor import BucketMeanPredictor, OraclePredictor


def test_learns_bucket_means_online():
    p = BucketMeanPredictor(edges=(100, 1000), prior=7)
    assert p.predict(0, 50) == 7  # nothing learned yet
    for o in (10, 20, 30):
        p.observe(0, 50, o)
    for o in (400, 600):
        p.observe(0, 500, o)
    assert p.predict(0, 80) == pytest.approx(20)
    assert p.predict(0, 999) == pytest.approx(500)
    assert p.predict(0, 5000) == pytest.approx((10 + 20 + 30 + 400 + 600) / 5)  # empty bucket: global mean
    assert set(p.bucket_means()) == {"(0, 100]", "(100, 1000]"}


def test_repredicts_with_conditional_mean():
    p = BucketMeanPredictor(edges=(100,)).fit([50] * 4, [10, 20, 300, 500])
    assert p.predict(0, 50) == pytest.approx(207.5)
    assert p.repredict(50, 250) == pytest.approx(400)  # mean of the outputs longer than 250
    assert p.predict(0, 50, 250) == pytest.approx(400)  # the same through the shared protocol
    assert p.predict(0, 50, 100) == pytest.approx(207.5)  # not yet outlived: still the mean
    assert p.repredict(50, 600) == 1200  # beyond all history: double
    p.observe(0, 50, 700)
    assert p.repredict(50, 600) == 700  # re-sorted after new data


def test_history_is_bounded():
    p = BucketMeanPredictor(history=2)
    for o in (1000, 10, 20):
        p.observe(0, 50, o)
    assert p.predict(0, 50) == pytest.approx(15)


def test_oracle():
    p = OraclePredictor({3: 42})
    assert p.predict(3, 10) == 42
    assert p.predict(3, 10, 50) == 51


def test_bad_edges():
    with pytest.raises(ValueError):
        BucketMeanPredictor(edges=(10, 5))
