import pytest

from kvserve.bench.prealloc_estimate import estimate, partial_block_waste, prealloc_concurrency


def test_prealloc_concurrency_hand_computed():
    # 512 blocks x 16 = 8192 tokens; longest request 1800 + 64 = 1864 -> 4 fit (7456), a 5th does not.
    assert prealloc_concurrency(8192, 1864) == 4
    assert prealloc_concurrency(1863, 1864) == 0
    assert prealloc_concurrency(1864, 1864) == 1
    with pytest.raises(ValueError):
        prealloc_concurrency(100, 0)


def test_estimate_ratio():
    est = estimate(num_blocks=512, block_size=16, max_request_len=1864, kvserve_peak=30)
    assert est.budget_tokens == 8192
    assert est.prealloc_concurrency == 4
    assert est.ratio == pytest.approx(7.5)
    assert estimate(1, 16, 1864, 3).ratio is None  # nothing fits contiguously
    assert est.to_dict()["ratio"] == pytest.approx(7.5)


def test_partial_block_waste_hand_computed():
    # lengths 16 (1 block, 0 waste), 17 (2 blocks, 15 waste), 40 (3 blocks, 8 waste)
    waste = partial_block_waste([16, 17, 40], 16)
    assert waste.used_tokens == 73
    assert waste.allocated_tokens == 96
    assert waste.waste_pct == pytest.approx(100 * 23 / 96)
    assert partial_block_waste([32, 64], 16).waste_pct == 0.0
    assert partial_block_waste([], 16).waste_pct == 0.0
    assert partial_block_waste([1], 16).waste_pct == pytest.approx(100 * 15 / 16)
    with pytest.raises(ValueError):
        partial_block_waste([1], 0)
