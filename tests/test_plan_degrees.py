"""DacpPlan's per-sequence CP degrees (SubgroupShards): validation, memory accounting, serialization."""

from __future__ import annotations

import json
import pickle

import pytest

from scheduling import DacpPlan, StepPlan, SubgroupShards


def _mixed() -> DacpPlan:
    # CP=4: sequence 0 local on rank 3, 1 over all four ranks, 2 over ranks {0,1}, 3 and 4 over {2,3}
    return DacpPlan(local=((), (), (), (0,)), distributed=(1,),
                    partial=(SubgroupShards(degree=2, group=0, indices=(2,)),
                             SubgroupShards(degree=2, group=1, indices=(3, 4))))


def test_rank_tokens_charge_each_degree_on_its_subgroup_only() -> None:
    lengths = [10, 9, 7, 5, 4]
    # every rank: ceil(9/4) = 3; ranks 0,1: ceil(7/2) = 4; ranks 2,3: ceil(5/2) + ceil(4/2) = 5; rank 3: +10
    assert _mixed().rank_tokens(lengths) == (7, 7, 8, 18)


def test_degree_of_and_partial_on() -> None:
    plan = _mixed()
    assert [plan.degree_of(i) for i in range(5)] == [1, 4, 2, 2, 2]
    assert [e.indices for e in plan.partial_on(0)] == [(2,)]
    assert [e.indices for e in plan.partial_on(3)] == [(3, 4)]
    assert sorted(plan.indices) == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError):
        plan.degree_of(5)


def test_mixed_plan_round_trips_through_json_and_pickle() -> None:
    step = StepPlan(micro_batches=((_mixed(),),))
    assert StepPlan.from_dict(json.loads(json.dumps(step.to_dict()))) == step
    assert pickle.loads(pickle.dumps(step)) == step


def test_two_level_plan_serializes_exactly_as_before() -> None:
    plan = DacpPlan(local=((0,), (2,)), distributed=(1,))
    assert plan.to_dict() == {"local": [[0], [2]], "distributed": [1]}
    assert DacpPlan.from_dict({"local": [[0], [2]], "distributed": [1]}) == plan


@pytest.mark.parametrize("entries, message", [
    ((SubgroupShards(degree=4, group=0, indices=(0,)),), "aligned subgroup"),   # degree N is `distributed`
    ((SubgroupShards(degree=3, group=0, indices=(0,)),), "aligned subgroup"),   # 3 does not divide 4
    ((SubgroupShards(degree=2, group=2, indices=(0,)),), "aligned subgroup"),   # only groups 0 and 1
    ((SubgroupShards(degree=2, group=1, indices=(0,)),
      SubgroupShards(degree=2, group=0, indices=(1,))), "one entry per"),     # not canonical order
    ((SubgroupShards(degree=2, group=0, indices=(0,)),
      SubgroupShards(degree=2, group=0, indices=(1,))), "one entry per"),     # (degree, group) twice
])
def test_invalid_subgroups_are_refused(entries: tuple[SubgroupShards, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DacpPlan(local=((),) * 4, partial=entries)


def test_a_sequence_at_two_degrees_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        DacpPlan(local=((0,), (), (), ()), partial=(SubgroupShards(degree=2, group=1, indices=(0,)),))
    with pytest.raises(ValueError, match="degree must be"):
        SubgroupShards(degree=1, group=0, indices=(0,))
    with pytest.raises(ValueError, match="at least one"):
        SubgroupShards(degree=2, group=0, indices=())
