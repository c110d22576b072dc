import itertools

import pytest

from kvserve.bench import workloads as wl

VOCAB = 49152


def _lengths(workload):
    return [(len(s.turns[0].new_token_ids), s.turns[0].max_tokens) for s in workload.sessions]


@pytest.mark.parametrize("name", ["mixed", "shared-prefix", "multi-turn", "cold-warm", "multi-prefix"])
def test_same_seed_same_requests_and_other_seed_differs(name):
    a = wl.build(name, 20, VOCAB, seed=7)
    b = wl.build(name, 20, VOCAB, seed=7)
    c = wl.build(name, 20, VOCAB, seed=8)
    assert a == b
    assert a != c


def test_mixed_lengths_and_token_range():
    w = wl.mixed(200, VOCAB, seed=1)
    assert w.num_requests == 200
    low, high = wl.token_id_range(VOCAB)
    for session in w.sessions:
        [turn] = session.turns
        assert 64 <= len(turn.new_token_ids) <= 512
        assert 32 <= turn.max_tokens <= 256
        assert all(low <= t < high for t in turn.new_token_ids)
    prompt_lens = [p for p, _ in _lengths(w)]
    assert min(prompt_lens) < 150 and max(prompt_lens) > 420  # the range is actually covered


def test_shared_prefix_shares_exactly_1500_tokens():
    w = wl.shared_prefix(50, VOCAB, seed=3)
    system = w.sessions[0].turns[0].new_token_ids[:1500]
    for session in w.sessions:
        prompt = session.turns[0].new_token_ids
        assert prompt[:1500] == system
        assert 50 <= len(prompt) - 1500 <= 300
    assert len({tuple(s.turns[0].new_token_ids[1500:]) for s in w.sessions}) == 50


def test_multi_turn_has_up_to_ten_turns_and_requested_count():
    w = wl.multi_turn(60, VOCAB, seed=2)
    assert w.num_requests == 60
    assert all(1 <= len(s.turns) <= 10 for s in w.sessions)
    assert any(len(s.turns) > 1 for s in w.sessions)


def test_max_request_len_accounts_for_resent_history():
    session = wl.Session("s", [wl.Turn([1] * 10, 5), wl.Turn([2] * 3, 4)])
    w = wl.Workload("multi-turn", [session])
    assert w.max_request_len() == 10 + 5 + 3 + 4


def test_cold_warm_same_requests_with_isolated_cold_salts():
    cold, warm = wl.cold_warm(10, VOCAB, seed=0)
    assert [s.turns for s in cold.sessions] == [s.turns for s in warm.sessions]
    assert len({s.cache_salt for s in cold.sessions}) == 10
    assert len({s.cache_salt for s in warm.sessions}) == 1
    [primer] = warm.warmup
    assert primer.cache_salt == warm.sessions[0].cache_salt
    assert primer.turns[0].new_token_ids == warm.sessions[0].turns[0].new_token_ids[:1500]
    assert not cold.warmup


def test_max_tokens_cap_and_small_vocab():
    w = wl.mixed(30, 300, seed=0, max_tokens_cap=8)
    assert all(s.turns[0].max_tokens == 8 for s in w.sessions)
    low, high = wl.token_id_range(300)
    assert (low, high) == (150, 300)
    assert all(low <= t < high for s in w.sessions for t in s.turns[0].new_token_ids)


def test_unknown_workload():
    with pytest.raises(ValueError, match="unknown workload"):
        wl.build("nope", 1, VOCAB, 0)


def test_multi_prefix_draws_every_request_from_k_distinct_system_prompts():
    w = wl.multi_prefix(200, VOCAB, seed=4, num_prefixes=5)
    heads = [tuple(s.turns[0].new_token_ids[: wl.MULTI_PREFIX_LEN]) for s in w.sessions]
    assert len(set(heads)) == 5, "five system prompts, each used"
    counts = sorted(heads.count(h) for h in set(heads))
    assert counts[0] >= 20, f"requests spread across them at random: {counts}"
    switches = sum(a != b for a, b in itertools.pairwise(heads))
    assert switches > 100, f"interleaved, not grouped: {switches} changes of prompt in 199 steps"
    for session in w.sessions:
        [turn] = session.turns
        assert 50 <= len(turn.new_token_ids) - wl.MULTI_PREFIX_LEN <= 200
        assert 16 <= turn.max_tokens <= 64
    with pytest.raises(ValueError, match="num_prefixes"):
        wl.multi_prefix(4, VOCAB, seed=0, num_prefixes=0)
