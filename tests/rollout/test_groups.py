"""Env groups: one seed per group, fresh training seeds every step, fixed validation seeds."""

from __future__ import annotations

import pytest

from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.rollout.groups import EnvGroups


def groups(n_groups=3, group_size=4, seeds=SeedSplits(train_start=1000, val_start=0, val_size=1000)):
    built = []

    def make_env():
        env = make("FrozenLake")
        built.append(env)
        return env

    return EnvGroups(make_env, n_groups, group_size, seeds), built


def test_a_group_shares_one_seed_and_groups_differ():
    pool, _ = groups()
    slots = pool.train_slots(0)
    assert len(slots) == pool.batch_size == 12
    by_group = {}
    for slot in slots:
        by_group.setdefault(slot.group, []).append(slot)
    assert sorted(by_group) == [0, 1, 2]
    for members in by_group.values():
        assert len({s.seed for s in members}) == 1
        assert [s.sample for s in members] == [0, 1, 2, 3]
    assert len({members[0].seed for members in by_group.values()}) == 3


def test_a_group_plays_the_same_level():
    pool, _ = groups(n_groups=2, group_size=3)
    for slot in pool.train_slots(5):
        slot.env.reset(seed=slot.seed)
    texts = [[s.env.text() for s in pool.train_slots(5) if s.group == g] for g in (0, 1)]
    assert all(len(set(t)) == 1 for t in texts)


def test_training_seeds_advance_every_step_and_never_repeat():
    pool, _ = groups()
    seen: set[int] = set()
    previous = None
    for step in range(50):
        seeds = {slot.seed for slot in pool.train_slots(step)}
        assert len(seeds) == 3
        assert not seeds & seen, f"step {step} reuses seeds"
        if previous is not None:
            assert min(seeds) > max(previous)
        seen |= seeds
        previous = seeds
    assert min(seen) == 1000


def test_validation_seeds_are_fixed_and_disjoint_from_training():
    pool, _ = groups()
    val = pool.val_slots(8, samples_per_seed=2)
    assert [(s.seed, s.sample) for s in val] == [(i, k) for i in range(8) for k in range(2)]
    assert [(s.seed, s.sample) for s in pool.val_slots(8, samples_per_seed=2)] == [(s.seed, s.sample) for s in val]
    train = {slot.seed for step in range(100) for slot in pool.train_slots(step)}
    assert not train & set(range(1000))


def test_validation_options_reach_every_slot():
    pool, _ = groups()
    assert all(s.options == {"level": 1} for s in pool.val_slots(3, options={"level": 1}))
    assert all(s.options is None for s in pool.train_slots(0))


def test_envs_are_built_lazily_once_and_reused_across_steps():
    pool, built = groups(n_groups=2, group_size=2)
    assert built == []
    first = [s.env for s in pool.train_slots(0)]
    second = [s.env for s in pool.train_slots(1)]
    assert len(built) == 4
    assert len({id(e) for e in first}) == 4, "each slot of a batch has its own env"
    assert [id(e) for e in first] == [id(e) for e in second]
    pool.val_slots(3, samples_per_seed=2)
    assert len(built) == 6, "a larger validation batch builds only the missing envs"


@pytest.mark.parametrize(("n_groups", "group_size"), [(0, 4), (2, 0), (-1, 1)])
def test_empty_groups_are_refused(n_groups, group_size):
    with pytest.raises(ValueError, match="n_groups and group_size"):
        EnvGroups(lambda: make("FrozenLake"), n_groups, group_size, SeedSplits())


def test_more_validation_seeds_than_reserved_are_refused():
    pool, _ = groups(seeds=SeedSplits(train_start=10, val_start=0, val_size=10))
    assert len(pool.val_slots(10)) == 10
    with pytest.raises(ValueError, match="val_size=10"):
        pool.val_slots(11)


def test_validation_slots_on_one_batch_of_envs_take_them_in_turn():
    """512 episodes in batches of 128 hold 128 envs (or env-server sessions), not 512."""
    pool = EnvGroups(lambda: object(), 1, 1, SeedSplits(100, 0, 50))
    slots = pool.val_slots(5, samples_per_seed=2, envs=4)
    assert [(s.group, s.sample) for s in slots] == [(g, k) for g in range(5) for k in range(2)]
    assert len({id(s.env) for s in slots}) == 4 and len(pool._envs) == 4
    assert [slots[i].env is slots[i + 4].env for i in range(6)] == [True] * 6
    assert len({id(s.env) for s in pool.val_slots(1, samples_per_seed=2, envs=4)}) == 2  # fewer episodes: fewer

