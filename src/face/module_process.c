/* The CPython face's process-wide calls: settings, the host budget, the disk directory, backends and devices, the hooks' state. */
#include "face/module.h"

#include <dlfcn.h>
#include <string.h>

#include "face/py_settings.h"
#include "hooks/variant.h"
#include "share/job.h"

/* ---- the settings that change at run time: a setter and a getter each -----------------------
 * One pair per RUN row of platform/config.h's table: set_<name> converts and checks
 * the value (face/py_settings.c) and hands it to the core's setter; get_<name> reads the core. */
#define SETTING_FUNCTIONS(name, type, set, get, doc)                                                           \
    PyDoc_STRVAR(set_##name##_doc, "set_" #name "($module, value, /)\n--\n\n" doc);                            \
    static PyObject *py_set_##name(PyObject *module, PyObject *value)                                          \
    {                                                                                                          \
        (void)module;                                                                                          \
        union tms_py_setting v;                                                                                \
        if (tms_py_setting_value(&tms_setting_rows[TMS_SETTING_##name], value, &v) < 0) return NULL;           \
        set(TMS_PY_SETTING_AS(type, v));                                                                       \
        Py_RETURN_NONE;                                                                                        \
    }                                                                                                          \
    PyDoc_STRVAR(get_##name##_doc, "get_" #name "($module, /)\n--\n\n" doc);                                   \
    static PyObject *py_get_##name(PyObject *module, PyObject *unused)                                         \
    {                                                                                                          \
        (void)module, (void)unused;                                                                            \
        return TMS_PY_SETTING_OBJECT(type, get());                                                             \
    }
/* And one pair per CALL row: a text kept by the layer that uses it, which may refuse a change
 * (its tms_<setter> and tms_<getter>, the row's names pasted after they are expanded). */
#define SETTING_TMS(x) SETTING_TMS_(x)
#define SETTING_TMS_(x) tms_##x
#define SETTING_TEXT_FUNCTIONS(name, set, get, doc)                                                            \
    PyDoc_STRVAR(set_##name##_doc, "set_" #name "($module, value, /)\n--\n\n" doc);                           \
    static PyObject *py_set_##name(PyObject *module, PyObject *value)                                          \
    {                                                                                                          \
        const char *text;                                                                                      \
        if (tms_py_setting_text(&tms_setting_rows[TMS_SETTING_##name], value, &text) < 0) return NULL;         \
        struct tms_err err = {0};                                                                              \
        int rc;                                                                                                \
        Py_BEGIN_ALLOW_THREADS                                                                                 \
        rc = SETTING_TMS(set)(text, &err);                                                                     \
        Py_END_ALLOW_THREADS                                                                                   \
        if (rc) return tms_py_raise(module, &err);                                                             \
        Py_RETURN_NONE;                                                                                        \
    }                                                                                                          \
    PyDoc_STRVAR(get_##name##_doc, "get_" #name "($module, /)\n--\n\n" doc);                                  \
    static PyObject *py_get_##name(PyObject *module, PyObject *unused)                                         \
    {                                                                                                          \
        (void)module, (void)unused;                                                                            \
        char buf[256];                                                                                         \
        SETTING_TMS(get)(buf, sizeof buf);                                                                     \
        if (!buf[0]) Py_RETURN_NONE;                                                                           \
        return PyUnicode_FromString(buf);                                                                      \
    }
#define SETTING_ROW(name, type, env, dflt, range, accepts, when, doc)                                          \
    TMS_SETTING_IF_RUN(when, SETTING_FUNCTIONS(name, type, TMS_SETTING_SETTER(when), TMS_SETTING_GETTER(when), doc)) \
    TMS_SETTING_IF_CALL(when, SETTING_TEXT_FUNCTIONS(name, TMS_SETTING_SETTER(when), TMS_SETTING_GETTER(when), doc))
TMS_SETTINGS(SETTING_ROW)

#define SETTING_METHODS(name, type, env, dflt, range, accepts, when, doc)                                      \
    TMS_SETTING_IF_RUN(when, {"set_" #name, py_set_##name, METH_O, set_##name##_doc},                          \
                       {"get_" #name, py_get_##name, METH_NOARGS, get_##name##_doc},)                          \
    TMS_SETTING_IF_CALL(when, {"set_" #name, py_set_##name, METH_O, set_##name##_doc},                         \
                        {"get_" #name, py_get_##name, METH_NOARGS, get_##name##_doc},)

PyDoc_STRVAR(host_budget_doc,
"host_budget($module, /)\n--\n\n"
"The host backup budget: {'name', 'limit' (0: none), 'reserved' (every process of the ledger),\n"
"'mine' (this process), 'free', 'mem_total', 'mem_available', 'safety', 'spill_to_disk',\n"
"'ledger' (its file; None where no private place could be had: this process counts alone)}.");
static PyObject *py_host_budget(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_ledger_info info;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_host_budget(&info, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    size_t free_bytes = info.limit > info.reserved ? info.limit - info.reserved : 0;
    return Py_BuildValue("{s:s,s:n,s:n,s:n,s:n,s:n,s:n,s:O,s:O,s:z}", "name", info.name, "limit",
                         (Py_ssize_t)info.limit, "reserved", (Py_ssize_t)info.reserved, "mine", (Py_ssize_t)info.mine,
                         "free", (Py_ssize_t)free_bytes, "mem_total", (Py_ssize_t)info.mem_total, "mem_available",
                         (Py_ssize_t)info.mem_available, "safety", info.safety ? Py_True : Py_False,
                         "spill_to_disk", tms_core_spill() ? Py_True : Py_False, "ledger",
                         info.alone || !info.ledger[0] ? NULL : info.ledger);
}

PyDoc_STRVAR(job_memory_doc,
"job_memory($module, device, /)\n--\n\n"
"(kept, lent, borrowed): bytes on device this process keeps idle for its job, has lent to\n"
"other members, and maps from memory other members lent.");
static PyObject *py_job_memory(PyObject *module, PyObject *args)
{
    (void)module;
    int device;
    if (!PyArg_ParseTuple(args, "i:job_memory", &device)) return NULL;
    if (device < 0) return PyErr_Format(PyExc_ValueError, "torch_memory_saver: device must be >= 0, got %d", device);
    size_t kept, lent, borrowed;
    Py_BEGIN_ALLOW_THREADS
    tms_job_memory(device, &kept, &lent, &borrowed);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(nnn)", (Py_ssize_t)kept, (Py_ssize_t)lent, (Py_ssize_t)borrowed);
}

PyDoc_STRVAR(use_backend_doc, "use_backend($module, name, /)\n--\n\nChoose 'cuda', 'hip' or 'host' before first use.");
static PyObject *py_use_backend(PyObject *module, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL;
    if (!name && !PyErr_Occurred()) return tms_py_type_error("use_backend: name", "a str", arg);
    if (!name) return NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* the driver lock is held while a backend loads */
    rc = tms_core_use_backend(name, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(backend_doc, "backend($module, /)\n--\n\nLoad the backend if needed and return its name.");
static PyObject *py_backend(PyObject *module, PyObject *unused)
{
    (void)unused;
    const char *name = NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_backend(&name, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return PyUnicode_FromString(name);
}

PyDoc_STRVAR(warm_backups_doc,
"warm_backups($module, /)\n--\n\n"
"Start the copy workers and pin their staging buffers on a thread of their own,\n"
"so the first backed-up pause finds them ready; returns at once.");
static PyObject *py_warm_backups(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_warm_backups(&err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_progress_doc,
"copy_progress($module, /)\n--\n\n(bytes done, bytes total) of the backup copy running now (or the last one).");
static PyObject *py_copy_progress(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    size_t done, total;
    tms_core_copy_progress(&done, &total);
    return Py_BuildValue("(nn)", (Py_ssize_t)done, (Py_ssize_t)total);
}

PyDoc_STRVAR(set_platform_hint_doc,
"set_platform_hint($module, platform, /)\n--\n\n"
"The platform PyTorch was built for ('cuda' or 'hip'; None: unknown): the backend\n"
"chosen when TMS_BACKEND and TMS_PLATFORM say nothing.");
static PyObject *py_set_platform_hint(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *platform = NULL;
    if (arg != Py_None && !(platform = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL)) {
        if (!PyErr_Occurred()) return tms_py_type_error("set_platform_hint: platform", "a str or None", arg);
        return NULL;
    }
    tms_core_set_platform_hint(platform);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(loaded_backend_doc, "loaded_backend($module, /)\n--\n\nName of the loaded backend, or None.");
static PyObject *py_loaded_backend(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *name = tms_core_loaded_backend();
    if (!name) Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

PyDoc_STRVAR(device_active_doc,
"device_active($module, device, /)\n--\n\n"
"True if the process already uses the device (its primary context is active); asking creates nothing there.");
static PyObject *py_device_active(PyObject *module, PyObject *args)
{
    int device, active = 0;
    if (!PyArg_ParseTuple(args, "i:device_active", &device)) return NULL;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_device_active(device, &active, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return PyBool_FromLong(active);
}

PyDoc_STRVAR(current_device_doc,
"current_device($module, /)\n--\n\n"
"The calling thread's device, where its regions' allocations land (loads the backend).");
static PyObject *py_current_device(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    struct tms_err err = {0};
    int rc, device = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_current_device(&device, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return PyLong_FromLong(device);
}

PyDoc_STRVAR(mem_get_info_doc,
"mem_get_info($module, device, /)\n--\n\n"
"(free bytes, total bytes) of a device, as the backend reports them (loads it).");
static PyObject *py_mem_get_info(PyObject *module, PyObject *args)
{
    int device;
    if (!PyArg_ParseTuple(args, "i:mem_get_info", &device)) return NULL;
    if (device < 0) return PyErr_Format(PyExc_ValueError, "torch_memory_saver: device must be >= 0, got %d", device);
    struct tms_err err = {0};
    size_t free_bytes = 0, total = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tms_core_mem_get_info(device, &free_bytes, &total, &err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    return Py_BuildValue("(nn)", (Py_ssize_t)free_bytes, (Py_ssize_t)total);
}

/* ---- the allocator hooks' questions: offered where the variant has them (module.c) ---------- */

PyDoc_STRVAR(preload_active_doc,
"preload_active($module, /)\n--\n\n"
"(active, winner): active is True if this library's cudaMalloc is the one the\n"
"process uses (loaded through LD_PRELOAD); winner is the path of the library\n"
"whose cudaMalloc the process resolves, or None.");
static PyObject *py_preload_active(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *winner = NULL;
    int active = tms_variant_preload_active(&winner);
    if (!winner) return Py_BuildValue("(NO)", PyBool_FromLong(active), Py_None);
    return Py_BuildValue("(Ns)", PyBool_FromLong(active), winner);
}

PyDoc_STRVAR(install_relocation_hooks_doc,
"install_relocation_hooks($module, /)\n--\n\n"
"Point every loaded object's GOT entries for cudaMalloc/cudaFree (hipMalloc/hipFree)\n"
"at this library's hooks, and those of objects loaded later (through dlopen): preload\n"
"mode without LD_PRELOAD. Idempotent. NotImplementedError if TMS_RELOC_HOOKS=0.");
static PyObject *py_install_relocation_hooks(PyObject *module, PyObject *unused)
{
    (void)unused;
    struct tms_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS  /* walks every object's relocations */
    rc = tms_variant_install_relocation(&err);
    Py_END_ALLOW_THREADS
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(relocation_report_doc,
"relocation_report($module, /)\n--\n\n"
"(patched, static_runtime): the objects whose GOT entries were patched, and those that\n"
"define cudaMalloc themselves (a statically linked runtime, not hookable by relocation).");
static PyObject *py_relocation_report(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    char patched[8192], statics[4096];
    tms_variant_relocation_report(patched, sizeof patched, statics, sizeof statics);
    return Py_BuildValue("(ss)", patched, statics);
}

PyDoc_STRVAR(preload_method_doc,
"preload_method($module, /)\n--\n\n"
"How this process's allocations reach the hooks: 'ld_preload', 'relocation', or None.");
static PyObject *py_preload_method(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const char *method = tms_variant_preload_method();
    if (!method) Py_RETURN_NONE;
    return PyUnicode_FromString(method);
}

PyMethodDef tms_py_preload_methods[] = {
    {"preload_active", py_preload_active, METH_NOARGS, preload_active_doc},
    {"install_relocation_hooks", py_install_relocation_hooks, METH_NOARGS, install_relocation_hooks_doc},
    {"relocation_report", py_relocation_report, METH_NOARGS, relocation_report_doc},
    {"preload_method", py_preload_method, METH_NOARGS, preload_method_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(library_path_doc, "library_path($module, /)\n--\n\nPath of this shared library.");
static PyObject *py_library_path(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    Dl_info info;
    if (!dladdr((void *)py_library_path, &info) || !info.dli_fname)
        return PyErr_Format(PyExc_OSError, "dladdr cannot name the library holding " TMS_MODULE_NAME);
    return PyUnicode_DecodeFSDefault(info.dli_fname);
}

PyDoc_STRVAR(last_hook_error_doc, "last_hook_error($module, /)\n--\n\nMessage of this thread's last failed hook call.");
static PyObject *py_last_hook_error(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyUnicode_FromString(tms_core_last_error());
}

PyDoc_STRVAR(defaults_doc, "defaults($module, /)\n--\n\nProcess defaults read from TMS_* environment variables.");
static PyObject *py_defaults(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const struct tms_defaults *d = tms_defaults();
    return Py_BuildValue("{s:O,s:O,s:s,s:O,s:O,s:n,s:n,s:O,s:O,s:O,s:z}", "init_enable", d->init_enable ? Py_True : Py_False,
                         "init_enable_cpu_backup", d->init_backup ? Py_True : Py_False,
                         "init_cpu_backup_backend", d->init_backup_backend,
                         "init_enable_disk_backup", d->init_disk_backup ? Py_True : Py_False,
                         "retain_cpu_backup", d->retain_cpu_backup ? Py_True : Py_False, "chunk_bytes",
                         (Py_ssize_t)d->chunk_bytes, "disk_backup_chunk_bytes", (Py_ssize_t)d->disk_block_bytes,
                         "progress", d->progress ? Py_True : Py_False, "backup_live_only",
                         d->backup_live_only ? Py_True : Py_False, "spill_to_disk", d->spill_to_disk ? Py_True : Py_False,
                         "job", d->job[0] ? d->job : NULL);
}

PyDoc_STRVAR(set_disk_backup_dir_doc,
"set_disk_backup_dir($module, path, /)\n--\n\n"
"Make path (created if missing) the process's directory for backup files; files left\n"
"there by dead processes are removed.");
static PyObject *py_set_disk_backup_dir(PyObject *module, PyObject *arg)
{
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &bytes)) return NULL;
    const char *path = PyBytes_AsString(bytes);
    struct tms_err err = {0};
    int rc = TMS_E_ARG;
    if (path && strlen(path) != (size_t)PyBytes_Size(bytes)) {
        tms_fail(&err, TMS_E_ARG, 0, "disk backup directory contains a null character");
    } else if (path) {
        Py_BEGIN_ALLOW_THREADS  /* mkdir, locks and a directory sweep */
        rc = tms_core_set_disk_dir(path, &err);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(bytes);
    if (!path) return NULL;
    if (rc) return tms_py_raise(module, &err);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(disk_backup_dir_doc, "disk_backup_dir($module, /)\n--\n\nThe directory backup files are created in now.");
static PyObject *py_disk_backup_dir(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    char dir[4096];
    Py_BEGIN_ALLOW_THREADS
    tms_core_disk_dir(dir, sizeof dir);
    Py_END_ALLOW_THREADS
    return PyUnicode_DecodeFSDefault(dir);
}

PyMethodDef tms_py_process_methods[] = {
    TMS_SETTINGS(SETTING_METHODS)
    {"set_platform_hint", py_set_platform_hint, METH_O, set_platform_hint_doc},
    {"host_budget", py_host_budget, METH_NOARGS, host_budget_doc},
    {"job_memory", py_job_memory, METH_VARARGS, job_memory_doc},
    {"use_backend", py_use_backend, METH_O, use_backend_doc},
    {"backend", py_backend, METH_NOARGS, backend_doc},
    {"loaded_backend", py_loaded_backend, METH_NOARGS, loaded_backend_doc},
    {"warm_backups", py_warm_backups, METH_NOARGS, warm_backups_doc},
    {"copy_progress", py_copy_progress, METH_NOARGS, copy_progress_doc},
    {"mem_get_info", py_mem_get_info, METH_VARARGS, mem_get_info_doc},
    {"device_active", py_device_active, METH_VARARGS, device_active_doc},
    {"current_device", py_current_device, METH_NOARGS, current_device_doc},
    {"library_path", py_library_path, METH_NOARGS, library_path_doc},
    {"last_hook_error", py_last_hook_error, METH_NOARGS, last_hook_error_doc},
    {"defaults", py_defaults, METH_NOARGS, defaults_doc},
    {"set_disk_backup_dir", py_set_disk_backup_dir, METH_O, set_disk_backup_dir_doc},
    {"disk_backup_dir", py_disk_backup_dir, METH_NOARGS, disk_backup_dir_doc},
    {NULL, NULL, 0, NULL},
};
