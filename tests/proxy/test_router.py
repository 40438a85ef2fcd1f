"""The prefix router's rules, request by request."""

import random

from tandem.proxy.router import PrefixRouter

A, B = 0, 1
TEMPLATE = list(range(1000, 1016))  # one block: a chat template every prompt starts with


def problem(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return TEMPLATE + [rng.randrange(5000) for _ in range(16 * blocks)]


def test_a_four_request_walkthrough():
    """The HF Jobs LoRA async-GRPO blog post's walkthrough: A and B each have 3 requests in flight and both know
    only the template block h1."""
    router = PrefixRouter(2)
    for replica in (A, B):
        router.record(router.block_hashes("policy", TEMPLATE), replica)
    p0, p1 = problem(0, 7), problem(1, 5)  # problem 0: h1..h8; problem 1: h1, h2'..h6'

    first = router.choose("policy", p0, inflight=[3, 3])
    assert (first.replica, first.kind) == (A, "unmatched")  # only the common template matches; round robin picks A
    second = router.choose("policy", p0, inflight=[4, 3])
    assert (second.replica, second.kind, second.specific_blocks) == (A, "affinity", 7)
    third = router.choose("policy", p1, inflight=[5, 3])
    assert (third.replica, third.kind) == (B, "unmatched")  # a new prompt goes to the less loaded B
    fourth = router.choose("policy", p0, inflight=[12, 3])
    assert (fourth.replica, fourth.kind) == (B, "spilled")  # A holds 7 specific blocks but is 9 requests ahead
    # Both replicas now hold problem 0: its blocks are common, and later rollouts go by load alone, counted
    # unmatched (the replica chosen still holds the whole prompt in its cache).
    fifth = router.choose("policy", p0, inflight=[6, 4])
    assert (fifth.replica, fifth.kind, fifth.specific_blocks) == (B, "unmatched", 0)
    stats = router.stats()
    assert (stats["routed"], stats["affinity"], stats["spilled"], stats["unmatched"]) == (5, 1, 1, 3)


def test_the_same_prompt_sticks_and_distinct_prompts_spread():
    router = PrefixRouter(2)
    inflight = [0, 0]
    homes = {router.choose("policy", problem(7, 4), inflight).replica for _ in range(8)}
    assert len(homes) == 1
    placed = [0, 0]
    for seed in range(100, 116):
        replica = router.choose("policy", problem(seed, 4), inflight).replica
        placed[replica] += 1
    assert placed == [8, 8], "new prompts alternate on equal load"
    continuation = problem(7, 4) + list(range(40))
    assert router.choose("policy", continuation, inflight).replica in homes


def test_a_shared_chat_template_does_not_count_as_affinity():
    router = PrefixRouter(2)
    kinds = [router.choose("policy", problem(seed, 3), [0, 0]).kind for seed in range(20)]
    assert kinds.count("affinity") <= 2 and kinds.count("unmatched") >= 18


def test_a_new_adapter_version_starts_a_new_namespace():
    router = PrefixRouter(2)
    router.choose("tandem-policy-v1", problem(3, 4), [0, 0])
    assert router.choose("tandem-policy-v2", problem(3, 4), [0, 0]).kind == "unmatched"
    assert router.choose("tandem-policy-v2", problem(3, 4), [0, 0]).kind == "affinity"


def test_imbalance_forces_a_spill():
    router = PrefixRouter(2, imbalance=2)
    home = router.choose("policy", problem(5, 4), [0, 0]).replica
    busy = [0, 0]
    busy[home] = 3
    decision = router.choose("policy", problem(5, 4), busy)
    assert decision.kind == "spilled" and decision.replica != home


def test_a_replica_that_lost_its_cache_loses_its_affinity():
    router = PrefixRouter(2)
    home = router.choose("policy", problem(9, 4), [0, 0]).replica
    router.forget(home)
    assert router.choose("policy", problem(9, 4), [0, 0]).kind == "unmatched"


def test_text_prompts_are_hashed_in_blocks_of_bytes():
    router = PrefixRouter(2)
    text = ("You are a helpful assistant. " * 10).encode()
    assert len(router.block_hashes("m", text)) == len(text) // 64
    assert router.block_hashes("m", text[:63]) == []
