"""Sharing pauseable memory with other processes, on the host backend: the handle
protocol between two processes (tests/host_scenarios/share.py), every byte checked,
with receivers that close, die, fork, outlive their sender, hang up without letting go
or run as another user, handles forged or replayed, and floods of connections. The GPU
paths (torch.multiprocessing, both hook modes) are in test_gpu.py."""
import os
import subprocess
import sys

import pytest

from host_scenarios import share


@pytest.mark.parametrize("case", [share.round_trip, share.sender_exits_first, share.fake_sender, share.sender_hung_up],
                         ids=["round_trip", "sender_exits_first", "fake_sender", "sender_hung_up"])
def test_share_between_two_processes(in_child, case):
    in_child(case)


def test_memory_made_without_exportable_handles_says_so(in_child):
    in_child(share.not_shareable, env={"TMS_SHAREABLE": "0"})


def test_another_users_process_gets_nothing(in_child, other_uids):
    _, attacker = other_uids
    in_child(share.other_user, attacker, attacker)


def test_a_receiver_that_hangs_up_without_letting_go_is_reported_not_released(in_child):
    # It keeps the memory's descriptor and lives: the pause goes ahead, its report lists the
    # allocation and the receiver's pid, and counts none of it released.
    in_child(share.hung_up_receiver)


def test_idle_connections_of_this_user_cannot_take_the_senders_descriptors(in_child):
    # 1,100 connections that never ask, against a sender limited to 1,024 descriptors.
    in_child(share.idle_flood, timeout=120)


def test_one_process_holds_at_most_half_of_the_senders_connections(in_child):
    # Its connections and hang-ups (each a watched process) leave room for every other receiver.
    in_child(share.one_peer_holds_its_share)


def test_a_flood_of_connections_costs_the_sender_a_bounded_share_of_a_core(in_child):
    in_child(share.refusal_flood, timeout=120)


def test_another_users_flood_is_refused_within_the_same_bound(in_child, other_uids):
    _, attacker = other_uids
    in_child(share.refusal_flood, attacker, attacker, timeout=120)


def test_a_receiver_without_the_package_is_told_its_name(run_py):
    # PyTorch's handle of our memory travels as a bytes subclass whose unpickling imports
    # this package (and hooks the receiver): a receiver without it fails naming it.
    sender = run_py("""
        import pickle
        from torch_memory_saver import _share
        handle = b"\\x02c" + _share.MAGIC + bytes(56)
        marked = _share._HandleBytes(handle)
        assert _share.is_our_handle(handle) and not _share.is_our_handle(b"\\x02c" + bytes(64))
        assert pickle.loads(pickle.dumps(marked)) == handle  # here the package is importable
        print(pickle.dumps((1, marked)).hex())
        """, prelude=False)
    assert sender.returncode == 0, sender.stderr
    proc = subprocess.run([sys.executable, "-S", "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                          input=bytes.fromhex(sender.stdout.strip()), capture_output=True, cwd="/", timeout=60,
                          env={"PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 1 and b"No module named 'torch_memory_saver'" in proc.stderr, proc.stderr
    # With the package, unpickling loads the library and hooks the runtime's IPC calls
    # before PyTorch opens the handle, and hands PyTorch plain bytes.
    receiver = run_py(f"""
        import pickle
        from torch_memory_saver import torch_memory_saver as tms
        assert tms._impl is None
        _, handle = pickle.loads(bytes.fromhex("{sender.stdout.strip()}"))
        assert type(handle) is bytes and handle[2:10] == b"TMSSHR01", type(handle)
        assert tms._impl is not None
        print("hooked")
        """, prelude=False)
    assert receiver.returncode == 0 and receiver.stdout == "hooked\n", receiver.stderr
