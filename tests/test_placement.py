"""Where a server's instances run is decided before any is spawned (infer.placement): the server only executes it."""

from dlrm_lab.config import load_preset
from dlrm_lab.infer.placement import Placement, place_instances, spare_cores
from dlrm_lab.infer.served import ServedModel

TINY = load_preset("tiny")


def test_instances_take_the_next_cores_in_turn_numbered_over_the_models():
    a = ServedModel("a", TINY, instances=2, threads=2)
    b = ServedModel("b", TINY, instances=1, threads=3)
    places = place_instances([a, b], "cpu", pin_cores=True, cores=[0, 1, 2, 3, 4, 5, 6])
    assert places == {
        "a": [Placement(0, (0, 1), "cpu"), Placement(1, (2, 3), "cpu")],
        "b": [Placement(2, (4, 5, 6), "cpu")],
    }
    # more threads than cores: the cores are handed out again from the first (the server warns of it first)
    assert [p.cores for p in place_instances([a, b], "cpu", True, cores=[0, 1, 2])["b"]] == [(1, 2, 0)]


def test_unpinned_instances_get_no_cores_and_gpus_are_shared_in_turn():
    a = ServedModel("a", TINY, instances=3, threads=2)
    assert all(p.cores == () for p in place_instances([a], "cpu", pin_cores=False, cores=[0, 1])["a"])
    on_gpus = place_instances([a], "cuda", pin_cores=True, cores=[0, 1], gpus=2)["a"]
    assert [(p.device, p.cores) for p in on_gpus] == [("cuda:0", ()), ("cuda:1", ()), ("cuda:0", ())]


def test_the_serving_process_gets_the_cores_no_pinned_instance_has():
    a = ServedModel("a", TINY, instances=2, threads=1)
    places = place_instances([a], "cpu", pin_cores=True, cores=[0, 1, 2])
    assert spare_cores(places, cores=[0, 1, 2]) == (2,)
    assert spare_cores(places, cores=[0, 1]) == ()  # the instances take every core: none spare
    unpinned = place_instances([a], "cpu", pin_cores=False, cores=[0, 1, 2])
    assert spare_cores(unpinned, cores=[0, 1, 2]) == ()  # an unpinned instance may run anywhere
