"""A process touches only the devices it uses (tests/host_scenarios/devices.py): on
the host backend, whose devices get a "context" at their first use as CUDA's do, a
process on device 1 never touches device 0, and one using both devices keeps both."""
from host_scenarios import devices


def test_a_process_on_device_1_never_touches_device_0(in_child):
    out = in_child.output(devices.every_call_on_one_device, env={"TMS_HOST_CURRENT_DEVICE": "1"})
    assert out == "only device 1\n"


def test_a_process_using_two_devices_pauses_and_resumes_on_both(in_child):
    out = in_child.output(devices.two_devices_in_one_process, env={"TMS_HOST_CURRENT_DEVICE": "1"})
    assert out == "both devices\n"


def test_the_current_device_is_checked(in_child):
    child = in_child.run(devices.two_devices_in_one_process, env={"TMS_HOST_CURRENT_DEVICE": "2"})
    assert child.returncode == 1 and "TMS_HOST_CURRENT_DEVICE='2' is not a device from 0 to 1" in child.stderr, \
        child.describe()
