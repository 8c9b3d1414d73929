"""A pause or resume from Python is one call into the core: the tags checked, PyTorch's
free blocks asked for only if the pause backs something up, and the call made; the
driver's free memory is asked for only where the report is asked for or logged
(tests/host_scenarios/api.py)."""
from host_scenarios import api


def test_a_pause_or_resume_is_one_call_into_the_core(in_child):
    in_child(api.one_call_into_the_core)


def test_the_free_blocks_are_asked_for_only_if_the_pause_backs_something_up(in_child):
    refused = in_child(api.free_blocks_asked_only_for_a_backup)
    assert [kind for kind, _ in refused] == ["ValueError", "ValueError"], refused
