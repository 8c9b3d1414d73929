"""Bad input that test_api.py and test_host_backend.py leave out: every
case gets a clear exception, never a crash, an exit or a wrong action.

Already covered there: unknown hook_mode and changing it after first use;
cpu_backup_backend without backup or unknown; non-str and empty tags (region,
pause, resume, cuda_graph, native); pause/resume of an unknown tag (a no-op);
double pause/resume (RuntimeError naming the tag, both variants); negative and
non-int memory_margin_bytes; malformed TMS_INIT_*/TMS_RETAIN_*/TMS_CHUNK_BYTES/
TMS_BACKEND/TMS_FAULT/TMS_HOST_* values; native get_cpu_backup ranges.

Here: tags that are str but not usable (embedded NUL, unencodable, non-ASCII,
very long); get_cpu_backup of CPU tensors over host-backend memory (not in a
region, slices, non-contiguous and stride-0 views, past the end, empty);
malformed TMS_BACKUP_THREADS / TMS_BACKUP_BLOCK_BYTES and more TMS_FAULT /
TMS_HOST_* forms; integers out of range for the native API and for
memory_margin_bytes; the preload-mode "LD_PRELOAD missing" message (the check
the GPU path runs, called directly: without a GPU it is never reached).
"""
import pytest

from conftest import check_ok
from host_scenarios import bad_input

# ---- tags -----------------------------------------------------------------------


def test_tag_with_embedded_nul_is_rejected_not_truncated(run_scenario):
    # A tag cut at the NUL would make pause("kv\0junk") pause tag "kv".
    out = check_ok(run_scenario("bad_input", "nul_in_tag"))
    assert out == "done\n"


def test_unencodable_non_ascii_and_long_tags(run_scenario):
    out = check_ok(run_scenario("bad_input", "unusual_tags"))
    assert out == "done\n"


# ---- get_cpu_backup of tensors (CPU tensors over host-backend allocations) ------------


def test_get_cpu_backup_of_slices_views_and_foreign_tensors(run_scenario):
    pytest.importorskip("torch")
    out = check_ok(run_scenario("bad_input", "cpu_backup_of_views"))
    assert out == "done\n"


# ---- environment ----------------------------------------------------------------

# (variable, value, what the message must hold besides the variable's name)
_MALFORMED = [
    ("TMS_BACKUP_THREADS", "0", "'0'"),
    ("TMS_BACKUP_THREADS", "33", "'33'"),
    ("TMS_BACKUP_THREADS", "two", "'two'"),
    ("TMS_BACKUP_THREADS", "4x", "'4x'"),
    ("TMS_BACKUP_BLOCK_BYTES", "1000", "'1000'"),          # below 64 KiB
    ("TMS_BACKUP_BLOCK_BYTES", "1GiB", "'1GiB'"),          # above 256 MiB
    ("TMS_BACKUP_BLOCK_BYTES", "65537", "'65537'"),        # not whole pages
    ("TMS_BACKUP_BLOCK_BYTES", "8 MiB", "'8 MiB'"),
    ("TMS_INIT_ENABLE", " 1", "' 1'"),
    ("TMS_HOST_DEVICE_BYTES", "0", "'0'"),
    ("TMS_HOST_DEVICES", "0", "'0'"),
    ("TMS_HOST_DEVICES", "8MiB", "not a device count"),    # a count, not a size
    ("TMS_HOST_DEVICES", "2.0", "'2.0'"),
    ("TMS_HOST_NUMA_NODE", "-1", "not a NUMA node"),
    ("TMS_HOST_NUMA_NODE", "1024", "'1024'"),
    ("TMS_HOST_NUMA_NODE", "node0", "'node0'"),
    ("TMS_FAULT", "create", "'create'"),
    ("TMS_FAULT", "create:2x", "'create:2x'"),
    ("TMS_FAULT", "create:-1", "'create:-1'"),
    ("TMS_FAULT", "map:1,unmap", "'map:1,unmap'"),
    ("TMS_FAULT", "create:1," * 40, "too long"),
]


@pytest.mark.parametrize("var,value,fragment", _MALFORMED,
                         ids=[f"{v}={x[:12]!r}" for v, x, _ in _MALFORMED])
def test_more_malformed_env_values_raise_at_import_naming_variable_and_value(run_scenario, var, value, fragment):
    out = check_ok(run_scenario("import_env", "package", var, fragment, env={var: value}))
    assert out == "done\n"


# ---- integers out of range ------------------------------------------------------


def test_native_integer_arguments_out_of_range(run_scenario):
    out = check_ok(run_scenario("bad_input", "native_integers_out_of_range"))
    assert out == "done\n"


def test_get_cpu_backup_pointer_beyond_64_bits_raises(run_scenario):
    # A pointer parsed without an overflow check would make p + 2**64 return p's backup.
    out = check_ok(run_scenario("bad_input", "backup_pointer_beyond_64_bits"))
    assert out == "done\n"


def test_margin_beyond_size_t_before_first_use_raises_at_assignment(run_scenario):
    # Accepted before first use, it would make every later call raise an
    # OverflowError not naming the setting, and the core never start.
    out = check_ok(run_scenario("bad_input", "margin_beyond_size_t_before_first_use"))
    assert out == "done\n"


# ---- preload mode without LD_PRELOAD -------------------------------------------------


def test_missing_ld_preload_message_says_how_to_fix(run_scenario, built_libs):
    # The check regions run in preload mode on a GPU backend (entrypoint.py
    # _Impl.on_gpu); here it is called directly: with the library on LD_PRELOAD,
    # without it (relocation hooks), and without it with TMS_RELOC_HOOKS=0.
    assert check_ok(run_scenario("bad_input", "ensure_hooked", env={"TMS_RELOC_HOOKS": "0"})) == "raised\n"
    assert check_ok(run_scenario("bad_input", "ensure_hooked")) == "relocation\n"
    preloaded = run_scenario("bad_input", "ensure_hooked", env={"LD_PRELOAD": built_libs["preload"]})
    assert check_ok(preloaded) == "ld_preload\n"


def test_a_disk_backup_dir_with_a_nul_is_refused_naming_it(in_child):
    in_child(bad_input.disk_backup_dir_with_nul)
