"""Pinned plans: the planner's speed work (issue 29) must not change a single plan.

Every case below is a fixed global batch (lengths written out, so a change to scheduling.distributions cannot
move them) planned by four policies that share GDS, DACP and the refinement (skrull, dacp_only, gds_only,
roundrobin). The expected plans were written by the planner as it was before that work (commit dc3f4c6)
and cover its branches: roll-backs, DACP giving up for the all-sharded plan, empty and unplaceable
micro-batches, a larger micro-batch count winning on modeled time, label counts, partial ring overlap.
A plan that changes fails here; if a change is meant (a better plan), regenerate the pins and say why.
The planner's hoisted time formulas (cost.Clock) and per-sequence table (dacp_state.SequenceTable) are
checked against CostModel's plain formulas bit for bit: equal plans need equal floats.

Encoding of one plan: DP ranks joined by " # ", a DP rank's micro-batches by " ; ", a micro-batch is its
CP ranks' local indices ("," within a rank, "|" between ranks), "/", then its distributed indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from scheduling import CostModel, HardwareProfile, plan_step, shard_tokens
from scheduling.dacp_state import SequenceTable

SMALL = {"hidden_size": 896, "kv_hidden_size": 128, "num_layers": 24}
MODEL = {**SMALL, "formula": "model", "intermediate_size": 4864}
BIG = {"hidden_size": 3584, "kv_hidden_size": 512, "num_layers": 28, "num_params": 1}


@dataclass(frozen=True)
class Case:
    distribution: str
    dp: int
    cp: int
    bucket: int
    dims: dict[str, Any]
    profile: dict[str, float]
    lengths: list[int]
    labels: list[int] | None
    plans: dict[str, str] = field(repr=False)

    @property
    def id(self) -> str:
        return f"{self.distribution}-{len(self.lengths)}x{self.dp}x{self.cp}-C{self.bucket}"


def decode(text: str) -> dict[str, Any]:
    """The encoded plan (module docstring) as StepPlan.to_dict() writes it."""
    def ints(part: str) -> list[int]:
        return [int(i) for i in part.split(",")] if part else []

    def micro_batch(mb: str) -> dict[str, Any]:
        local, distributed = mb.split("/")
        return {"local": [ints(rank) for rank in local.split("|")], "distributed": ints(distributed)}

    return {"micro_batches": [[micro_batch(mb) for mb in rank.split(" ; ")] for rank in text.split(" # ")]}


CASES = [
    Case("lmsys", dp=2, cp=4, bucket=26000, dims=SMALL,
         profile={},
         lengths=[
            664, 35, 114, 631, 1010, 31, 177, 423, 158, 85, 435, 99, 293, 202, 49, 2685, 661, 661, 990,
            432, 153, 3263, 129, 129, 1292, 64, 160, 214, 379, 548, 80, 48, 298, 2027, 664, 376, 215, 408,
            232, 707, 130, 345, 267, 530, 379, 35, 1112, 209, 158, 524, 27, 919, 76, 107, 129, 313, 588,
            243, 671, 353, 653, 96, 245, 127,
         ],
         labels=None,
         plans={
             "skrull": (
                 "9,54,13,12,37,60,18,61|1,27,41,19,4,58,22|14,2,48,57,59,49,24,5|25,6,62,44,56,0,16,40/21 #"
                 " 15,26,63,30|33,10,32,36,20,31,52,35|46,34,3,43,42,47,23,53,50,28|51,39,17,29,7,55,38,8,11"
                 ",45/"
             ),
             "dacp_only": (
                 "24,16,28,42,6,20,2,14|46,10,44,38,48,54,50,58|4,0,56,32,62,26,40,30|18,60,12,36,8,22,52,34"
                 "/ # 25,53,47,41,7,29,51,39,43,37,17,11|9,27,59,19,3,33,55,13,57,31|45,61,23,35,49,15,63|21"
                 ",5,1/"
             ),
             "gds_only": (
                 "|||/5,1,14,25,9,61,2,22,54,40,48,6,13,27,57,62,12,41,59,44,37,19,49,56,60,16,0,58,18,4,24,"
                 "21 # |||/50,45,31,52,30,11,53,63,23,20,8,26,47,36,38,42,32,55,35,28,7,10,43,29,3,17,34,39,"
                 "51,46,33,15"
             ),
             "roundrobin": (
                 "5,9,54,13,12,37,60,18|1,61,40,27,41,19,16,4|14,2,48,57,59,49,0,24|25,22,6,62,44,56,58,21/ "
                 "# 50,30,23,47,32,7,3,51|45,11,20,36,55,10,17,46|31,53,8,38,35,43,34,33|52,63,26,42,28,29,3"
                 "9,15/"
             ),
         }),
    Case("chatqa2", dp=2, cp=8, bucket=16000, dims=SMALL,
         profile={},
         lengths=[
            20860, 21003, 10613, 2689, 234, 6966, 8272, 229, 823, 52154, 14611, 1278, 8799, 30954, 25894,
            22859, 7471, 10075, 15464, 86, 11659, 2184, 24828, 651, 15554, 24280, 1151, 25760, 24400, 94,
            16616, 211, 10321, 8834, 124, 4430, 20919, 4148, 544, 16272, 9082, 20567, 1297, 4257, 20612,
            10411, 10394, 1310,
         ],
         labels=None,
         plans={
             "skrull": (
                 "26|||||||/18,32,5,9 ; |21|8|7||||/24,44,45,40,28,3 ; |42|4|31|19|||/30,36,2,12,15,35 # |||"
                 "||||/10,39,1,6,16,13 ; |11|23|29||||/0,20,25,33,14,43 ; |47|38|34||||/41,46,17,22,27,37"
             ),
             "dacp_only": (
                 "||8|4||||/0,2,6 ; |||||||/10,14,12 ; |||||||/18,20,16 ; 34|||||||/24,30,32,40,36,28,42,26,"
                 "38,22 ; |||||||/44,46 # 11|7||||||/1,13,5,3,9 ; 23|31|29|||||/39,15,19,17,33,25,35,37,21,2"
                 "7 ; ||47|||||/41,45,43 ; |||||||/ ; |||||||/"
             ),
             "gds_only": (
                 "|||||||/26,5,32,18,9 ; |||||||/7,8,21,3,40,45,24,44,28 ; |||||||/19,31,4,42,35,12,2,30,36,"
                 "15 # |||||||/29,23,37,6,46,39,1,27 ; |||||||/34,11,43,33,20,41,25,14 ; |||||||/38,47,16,17"
                 ",10,0,22,13"
             ),
             "roundrobin": (
                 "19|4|42|35|40|2||/30,15 ; 31|8|21|5||||/18,44,32,28 ; 7|26||||||/24,36,45,12,3,9 # 29|23|3"
                 "7|||||/39,1,46,6,27 ; 34|11|43|||||/41,20,25,33,14 ; 38|47||||||/10,0,17,16,22,13"
             ),
         }),
    Case("wikipedia", dp=1, cp=8, bucket=26000, dims=MODEL,
         profile={},
         lengths=[
            266, 1279, 336, 320, 82, 324, 59, 739, 340, 152, 667, 85, 324, 549, 246, 614, 5264, 279, 604,
            3881, 147, 371, 184, 342, 86, 163, 244, 1628, 770, 998, 74, 130, 591, 37, 184, 270, 618, 212,
            203, 230,
         ],
         labels=[
            133, 426, 84, 64, 13, 162, 19, 184, 68, 25, 333, 28, 81, 109, 41, 307, 1754, 69, 120, 646, 73,
            123, 46, 68, 14, 81, 81, 407, 154, 166, 37, 43, 147, 7, 30, 135, 206, 53, 40, 38,
         ],
         plans={
             "skrull": (
                 "33,9,10,5,0,23|6,25,29,2,8|34,35,13,7,31|17,21,28,37,26|11,27,4|24,38,1,14|39,12,15,18,30|"
                 "20,36,32,22,3/16,19"
             ),
             "dacp_only": (
                 "33,9,10,5,0,23|6,25,29,2,8|34,35,13,7,31|17,21,28,37,26|11,27,4|24,38,1,14|39,12,15,18,30|"
                 "20,36,32,22,3/16,19"
             ),
             "gds_only": (
                 "|||||||/33,6,30,4,11,24,31,20,9,25,22,34,38,37,39,26,14,0,35,17,3,5,12,2,8,23,21,13,32,18,"
                 "15,36,10,7,28,29,1,27,19,16"
             ),
             "roundrobin": (
                 "33,9,14,8,10|6,25,0,23,7|30,22,35,21,28|4,34,17,13,29|11,38,3,32,1|24,37,5,18,27|31,39,12,"
                 "15,19|20,26,2,36,16/"
             ),
         }),
    Case("uniform", dp=4, cp=2, bucket=12000, dims=MODEL,
         profile={},
         lengths=[
            3212, 3086, 19130, 11983, 14161, 14436, 17093, 689, 11653, 3551, 9636, 22278, 13147, 1691,
            13026, 3115, 18107, 22760, 23507, 14926, 20841, 8856, 3498, 12274, 10650, 15909, 23869, 6608,
            20538, 3312, 8346, 18913, 5944, 16089, 11016, 12298, 22591, 19602, 20141, 13178,
         ],
         labels=[
            1606, 1028, 4782, 2396, 2360, 7218, 5697, 172, 2330, 591, 4818, 7426, 3286, 338, 2171, 1557,
            6035, 5690, 4701, 2487, 10420, 2952, 874, 2454, 1775, 7954, 7956, 1652, 4107, 552, 4173, 6304,
            1486, 3217, 1836, 6149, 7530, 4900, 4028, 2196,
         ],
         plans={
             "skrull": (
                 "|/26 ; |/38 ; |/31,13 ; |/25,0 ; |/30,12 ; |/24,14 # |/18 ; |/28 ; |/1,37 ; |/33,9 ; |/32,"
                 "4 ; |/8,23 # |/36 ; |/20 ; |/29,2 ; |/22,6 ; |/27,39 ; |/34,3 # |/17 ; |/11 ; |/16 ; |/19,"
                 "15,7 ; |/21,5 ; |/10,35"
             ),
             "dacp_only": (
                 "|/4,0 ; |/8 ; |/12 ; |/16 ; |/20 ; |/24 ; |/28 ; |/32 ; |/36 # 9|1/13,5 ; |/17 ; |/21 ; |/"
                 "25,29 ; |/33 ; |/37 ; |/ ; |/ ; |/ # |/2 ; |/6 ; |/10,14 ; |/18 ; |/22 ; |/26 ; 34|30/ ; |"
                 "/38 ; |/ # |/3,7 ; |/11 ; |/19,15 ; |/27,23 ; |/31 ; |/35 ; |/39 ; |/ ; |/"
             ),
             "gds_only": (
                 "|/26 ; |/38 ; |/13,31 ; |/0,25 ; |/30,12 ; |/24,14 # |/18 ; |/28 ; |/1,37 ; |/9,33 ; |/32,"
                 "4 ; |/8,23 # |/36 ; |/20 ; |/29,2 ; |/22,6 ; |/27,39 ; |/34,3 # |/17 ; |/11 ; |/16 ; |/7,1"
                 "5,19 ; |/21,5 ; |/10,35"
             ),
             "roundrobin": (
                 "|/26 ; |/38 ; 13|/31 ; 0|/25 ; |/30,12 ; |/24,14 # |/18 ; |/28 ; |/1,37 ; 9|/33 ; |/32,4 ;"
                 " |/8,23 # |/36 ; |/20 ; |/29,2 ; |/22,6 ; |/27,39 ; 34|3/ # |/17 ; |/11 ; |/16 ; 7|15/19 ;"
                 " |/21,5 ; |/10,35"
             ),
         }),
    Case("lmsys", dp=4, cp=2, bucket=8000, dims=SMALL,
         profile={},
         lengths=[
            246, 85, 209, 344, 1020, 2403, 237, 442, 1597, 3711, 73, 208, 254, 403, 616, 62, 225, 117, 114,
            98, 384, 141, 3484, 740, 434, 4061, 342, 276, 3043, 990, 112, 139, 92, 220, 100, 193, 267, 732,
            488, 2753, 296, 144, 211, 206, 29, 792, 338, 242, 130, 1960, 2382, 1067, 813, 246, 496, 69,
            446, 221, 694, 311, 957, 920, 2911, 320, 1961, 1559, 166, 405, 313, 156, 484, 472, 117, 266,
            707, 332, 185, 22, 40, 60, 394, 836, 30, 3843, 969, 82, 392, 1720, 488, 472, 302, 359, 90, 401,
            839, 793,
         ],
         labels=None,
         plans={
             "skrull": (
                 "44,19,42,65,1|21,12,80,74,71,63/25 ; 55,43,59,95,64,61|31,47,91,38,5,24/ # 39,35,92|51,94,"
                 "58,56,20,40,53,17/82 ; 83|49,29,45,88,13,46,36,2,69,18/15 # 62,6,72|8,81,14,67,26,27,76/85"
                 ",77 ; 10,66,86,87,33|30,68,89,84,23,0/9 # 48,3,54,4|32,11,90,7,52,16/28,78 ; 22,93,57,41|5"
                 "0,60,37,70,75,73,34,79/"
             ),
             "dacp_only": (
                 "64,84,52,56,80,68,0,76,72,44,40|8,4,60,88,24,20,12,16,48,32,92,36/28 ; |/ # |/17,41,13,45,"
                 "49,1,21,33,37,9,29,5,25 ; 65,89,69,85,57|61,81,93,73,77,53/ # 62,58,54,38,86,6,2,18,78|50,"
                 "94,74,14,70,26,46,34/82,10,30,66,42,90,22 ; |/ # 39,23,67,3,27,35,19,15|87,51,95,71,7,91,6"
                 "3,11/79,55,31,43,47,59,75,83 ; |/"
             ),
             "gds_only": (
                 "|/44,1,31,43,47,59,91,24,38,95,65,5 ; |/55,19,21,42,12,63,80,71,74,61,64,25 # |/82,92,17,3"
                 "5,53,40,20,56,58,94,51,39 ; |/15,18,69,2,36,46,13,88,45,29,49,83 # |/77,85,72,76,6,27,26,6"
                 "7,14,81,8,62 ; |/10,30,66,33,0,68,86,89,23,84,87,9 # |/78,32,48,11,16,90,3,7,54,52,4,28 ; "
                 "|/79,34,41,57,73,75,93,70,37,60,50,22"
             ),
             "roundrobin": (
                 "44,31,47,91,38,65|1,43,59,24,95,5/ ; 55,21,12,80,74,64|19,42,63,71,61,25/ # 82,17,53,20,58"
                 ",51|92,35,40,56,94,39/ ; 15,69,36,13,45,49|18,2,46,88,29,83/ # 77,72,6,26,14,8|85,76,27,67"
                 ",81,62/ ; 10,66,0,86,23,87|30,33,68,89,84,9/ # 78,48,16,3,54,4|32,11,90,7,52,28/ ; 79,41,7"
                 "3,93,37,50|34,57,75,70,60,22/"
             ),
         }),
    Case("uniform", dp=1, cp=4, bucket=4000, dims=MODEL,
         profile={},
         lengths=[
            11761, 4530, 5692, 14565, 1686, 13110, 13056, 4681, 8059, 13358, 2516, 14474, 13310, 4548,
            13289, 14289, 6893, 6375, 1614, 9181, 4238, 3064, 6939, 13380, 10202, 14164, 358,
         ],
         labels=None,
         plans={
             "skrull": (
                 "|||/3 ; |||/11 ; |||/15 ; |||/25 ; |||/23 ; |||/9 ; |||/12 ; |||/14 ; |||/5 ; |||/6 ; |||/"
                 "18,0 ; |||/21,24 ; |||/20,19 ; |||/1,8 ; |||/13,10,22 ; |||/7,4,16 ; 26|||/2,17"
             ),
             "dacp_only": (
                 "|||/0 ; |||/1,2 ; |||/3 ; |||/4,5 ; |||/6 ; |||/7,8 ; |||/10,9 ; |||/11 ; |||/12 ; |||/13 "
                 "; |||/14 ; |||/15 ; |||/17,18,16 ; |||/20,19 ; |||/21,22 ; |||/23 ; |||/24 ; 26|||/25"
             ),
             "gds_only": (
                 "|||/3 ; |||/11 ; |||/15 ; |||/25 ; |||/23 ; |||/9 ; |||/12 ; |||/14 ; |||/5 ; |||/6 ; |||/"
                 "18,0 ; |||/21,24 ; |||/20,19 ; |||/1,8 ; |||/10,13,22 ; |||/4,7,16 ; |||/26,2,17"
             ),
             "roundrobin": (
                 "|||/3 ; |||/11 ; |||/15 ; |||/25 ; |||/23 ; |||/9 ; |||/12 ; |||/14 ; |||/5 ; |||/6 ; |||/"
                 "18,0 ; |||/21,24 ; |||/20,19 ; |||/1,8 ; |||/13,10,22 ; |||/7,4,16 ; 26|||/2,17"
             ),
         }),
    Case("chatqa2", dp=3, cp=4, bucket=4000, dims=MODEL,
         profile={},
         lengths=[
            16000, 16000, 16000, 12092, 4312, 16000, 16000, 266,
         ],
         labels=None,
         plans={
             "skrull": (
                 "|||/0 ; |||/5 ; |||/ # |||/1 ; |||/6 ; |||/ # |||/2 ; |||/3 ; 7|||/4"
             ),
             "dacp_only": (
                 "|||/0 ; |||/3 ; |||/6 # |||/1 ; 7|||/4 ; |||/ # |||/2 ; |||/5 ; |||/"
             ),
             "gds_only": (
                 "|||/0 ; |||/5 ; |||/ # |||/1 ; |||/6 ; |||/ # |||/2 ; |||/3 ; |||/7,4"
             ),
             "roundrobin": (
                 "|||/0 ; |||/5 ; |||/ # |||/1 ; |||/6 ; |||/ # |||/2 ; |||/3 ; 7|||/4"
             ),
         }),
    Case("chatqa2", dp=1, cp=4, bucket=16000, dims=MODEL,
         profile={},
         lengths=[
            13960, 3205, 21818, 12362, 12738, 20287, 8997, 7155, 617, 111, 19643, 15291, 28806, 8487,
         ],
         labels=None,
         plans={
             "skrull": (
                 "|||/0,6,7,12 ; |||/13,4,11,2 ; 8|9||/3,10,1,5"
             ),
             "dacp_only": (
                 "|||/0,3,2,1 ; 8|||/9,4,6,7,5 ; |||/11,10,12 ; |||/13"
             ),
             "gds_only": (
                 "|||/7,6,0,12 ; |||/13,4,11,2 ; |||/9,8,1,3,10,5"
             ),
             "roundrobin": (
                 "9|||/0,13,2 ; 8|||/11,6,12 ; 1|||/3,10 ; 7|||/4,5"
             ),
         }),
    Case("chatqa2", dp=1, cp=4, bucket=26000, dims=BIG,
         profile={"micro_batch_launch_s": 0.0005, "ring_overlap": 0.5},
         lengths=[
            9183, 56, 3602, 8244, 18491, 9250, 212, 10403, 16912, 311, 8422, 18803, 16264, 67, 29714, 9767,
            9750, 5004, 19864, 20563, 98, 8854, 13227, 22409, 6788, 765, 134, 288, 12739, 5084,
         ],
         labels=None,
         plans={
             "skrull": (
                 "|||/14,28,0,29 ; |||/23,22,7,21,25,26,13,1 ; |||/19,12,16,24,17 ; |9|27|6,20/18,8,15,10 ; "
                 "|||/11,4,5,3,2"
             ),
             "dacp_only": (
                 "|||/4,5,0,3,2,1 ; |||/11,8,7,10,9,6 ; |||/17,18,13,12,15,16,14 ; 22|28|21|24,25,27,26/19,2"
                 "0,29,23"
             ),
             "gds_only": (
                 "|||/1,26,27,9,17,3,0,15,22,4,14 ; |||/13,20,6,25,24,21,16,7,12,11,23 ; |||/2,29,10,5,28,8,"
                 "18,19"
             ),
             "roundrobin": (
                 "1,5|6,28|4|3/2,23 ; |||/17,11,27,22,13,16,10,14 ; 20,15|9,12|29,18|21/ ; 26,7|25,8|24|0/19"
             ),
         }),
]


@pytest.mark.parametrize("policy", ["skrull", "dacp_only", "gds_only", "roundrobin"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plans_are_the_pinned_ones(case: Case, policy: str) -> None:
    cost = CostModel.from_model_dims(profile=HardwareProfile(**case.profile), **case.dims)
    plan = plan_step(policy, case.lengths, dp_size=case.dp, cp_size=case.cp, bucket_size=case.bucket,
                     cost=cost, labels=case.labels)
    plan.check(case.lengths, case.bucket)
    assert plan.to_dict() == decode(case.plans[policy])


def test_pins_cover_what_they_claim() -> None:
    """The pinned cases hold the branches the docstring names (a pin set that lost them would pass
    vacuously): a micro-batch with no sequence, all-sharded micro-batches, several micro-batches."""
    plans = [decode(c.plans["skrull"]) for c in CASES]
    mbs = [mb for p in plans for rank in p["micro_batches"] for mb in rank]
    assert any(not mb["distributed"] and not any(mb["local"]) for mb in mbs)
    assert any(mb["distributed"] and not any(mb["local"]) for mb in mbs)
    assert any(mb["distributed"] and any(mb["local"]) for mb in mbs)
    assert any(len(p["micro_batches"][0]) > 1 for p in plans)


@pytest.mark.parametrize("cp", [1, 2, 8, 16])
@pytest.mark.parametrize("profile", [{}, {"ring_overlap": 0.5, "intra_node_comm_offset_s": -1e-5},
                                     {"gpus_per_node": 4, "inter_node_comm_offset_s": 2e-4}])
def test_clock_is_the_cost_model_bit_for_bit(cp: int, profile: dict[str, float]) -> None:
    """The planners' hoisted Clock must return exactly CostModel's floats (ties decide plans)."""
    cost = CostModel.from_model_dims(profile=HardwareProfile(**profile), **SMALL)
    clock = cost.clock(cp, world=4 * cp)
    rng = np.random.default_rng(cp)
    assert clock.overhead == cost.micro_batch_overhead_s(4 * cp)
    for volume, flops, dist in zip(rng.random(200) * 1e10, rng.random(200) * 1e14, rng.random(200) * 1e13,
                                   strict=True):
        volume, flops, dist = float(volume), float(flops), float(dist)
        assert clock.comp(flops) == cost.t_comp(flops)
        assert clock.comm(volume) == cost.t_comm(volume, cp)
        expected = cost.overlapped(cost.t_comm(volume, cp), cost.t_comp(flops)) + cost.t_comp(dist)
        assert clock.time(flops, dist, volume) == expected
    assert clock.comm(0.0) == cost.t_comm(0.0, cp) == 0.0


@pytest.mark.parametrize("subset", [False, True])
def test_sequence_table_is_the_scalar_formulas(subset: bool) -> None:
    cost = CostModel.from_model_dims(**MODEL)
    lengths = [int(s) for s in np.random.default_rng(0).integers(1, 5000, 300)] + [7, 7, 7]
    flops = cost.sequence_flops(lengths, [max(1, s // 3) for s in lengths])
    indices = list(range(0, len(lengths), 3)) if subset else list(range(len(lengths)))
    table = SequenceTable(lengths, flops, cost, indices if subset else None)
    for i in indices:
        assert table.lengths[i] == lengths[i]
        assert table.kv[i] == cost.kv_bytes(float(lengths[i]))
        assert table.shards(8)[i] == shard_tokens(lengths[i], 8)
        assert table.shard_flops(8)[i] == flops[i] / 8
    by_length = sorted(indices, key=lambda i: (lengths[i], i))
    assert sorted(indices, key=table.length_rank.__getitem__) == by_length
    assert list(table.weight_order) == sorted(indices, key=lambda i: (-flops[i], i))
