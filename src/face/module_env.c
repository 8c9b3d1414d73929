/* _tms_env: every TMS_* variable checked at `import torch_memory_saver` without loading a core; the settings table described, and run-time values checked, for the Python layer. */
#include "face/py_settings.h"

#include "core/core.h"

#define TMS_EXPORT __attribute__((visibility("default")))

static int module_exec(PyObject *module)
{
    (void)module;
    struct tms_err err = {0};
    if (tms_env_check(&err) == TMS_OK) return 0;
    PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", err.msg);
    return -1;
}

PyDoc_STRVAR(names_doc, "names($module, /)\n--\n\nThe TMS_* variables the library, its command line or its build reads.");

static PyObject *names(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && tms_env_name(i); i++) {
        PyObject *name = PyUnicode_FromString(tms_env_name(i));
        if (!name || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    return out;
}

PyDoc_STRVAR(is_known_doc, "is_known($module, name, /)\n--\n\n"
             "True if the library, its command line, its build or the project's tools read the variable.");

static PyObject *is_known(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (!name) return NULL;
    return PyBool_FromLong(tms_env_known(name));
}

/* A row of the table as the Python layer reads it. */
static PyObject *row_dict(const struct tms_setting_row *r)
{
    static const char *const groups[] = {
        [TMS_SETTING_GROUP_RUN] = "run", [TMS_SETTING_GROUP_ENV] = "env",
        [TMS_SETTING_GROUP_HOST] = "host", [TMS_SETTING_GROUP_OUTSIDE] = "outside", [TMS_SETTING_GROUP_CALL] = "run",
    };
    const char *kind = r->type == TMS_SETTING_TYPE_boolean ? "bool" : r->text || r->type == TMS_SETTING_TYPE_faults ? "str" : "int";
    PyObject *dflt = r->type == TMS_SETTING_TYPE_boolean ? PyBool_FromLong((long)r->number)
                     : r->text                        ? PyUnicode_FromString(r->text)
                     : r->type == TMS_SETTING_TYPE_faults ? Py_NewRef(Py_None)
                                                          : PyLong_FromLongLong(r->number);
    if (!dflt) return NULL;
    PyObject *d = Py_BuildValue("{s:s,s:z,s:s,s:s,s:O,s:O,s:s,s:s}", "name", r->name, "env", r->env, "type", kind,
                                "group", groups[r->group], "run",
                                r->group == TMS_SETTING_GROUP_RUN || r->group == TMS_SETTING_GROUP_CALL ? Py_True : Py_False,
                                "default", dflt, "accepts", tms_setting_accepts(r), "doc", r->doc);
    Py_DECREF(dflt);
    return d;
}

PyDoc_STRVAR(settings_doc,
"settings($module, /)\n--\n\n"
"The settings table (src/platform/config.h), a dict per row: name, env (its variable or None),\n"
"type ('bool', 'int' or 'str'), group ('run': also changed at run time, as get_<name> /\n"
"set_<name> of the native modules and the singleton's property <name>; 'env', 'host' or\n"
"'outside'), run, default, accepts and doc.");

static PyObject *settings(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    PyObject *out = PyList_New(TMS_SETTING_COUNT);
    for (Py_ssize_t i = 0; out && i < TMS_SETTING_COUNT; i++) {
        PyObject *d = row_dict(&tms_setting_rows[i]);
        if (!d || PyList_SetItem(out, i, d) < 0) Py_CLEAR(out);  /* SetItem steals d */
    }
    return out;
}

PyDoc_STRVAR(check_setting_doc,
"check_setting($module, name, value, /)\n--\n\n"
"Raise what set_<name>(value) of a native module would (TypeError, ValueError), without\n"
"a core: how a value given before the core is loaded is checked.");

static PyObject *check_setting(PyObject *module, PyObject *args)
{
    (void)module;
    const char *name;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "sO:check_setting", &name, &value)) return NULL;
    const struct tms_setting_row *r = tms_setting_find(name);
    if (!r || (r->group != TMS_SETTING_GROUP_RUN && r->group != TMS_SETTING_GROUP_CALL))
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: no setting %s changes at run time", name);
    const char *text;
    if (r->group == TMS_SETTING_GROUP_CALL) {
        if (tms_py_setting_text(r, value, &text) < 0) return NULL;
        Py_RETURN_NONE;
    }
    union tms_py_setting v;
    if (tms_py_setting_value(r, value, &v) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(report_fields_doc,
"report_fields($module, /)\n--\n\n"
"The byte counts of a pause's or resume's report per device, in order, as (name, doc) pairs\n"
"(src/core/core.h, TMS_REPORT_BYTES): the keys of the native report's device dicts and the\n"
"attributes of DeviceReport and Report.");

static PyObject *report_fields(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    static const char *const fields[][2] = {
#define TMS_REPORT_PAIR(field, name, doc) {name, doc},
        TMS_REPORT_BYTES(TMS_REPORT_PAIR)
#undef TMS_REPORT_PAIR
    };
    Py_ssize_t n = (Py_ssize_t)(sizeof fields / sizeof fields[0]);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *pair = Py_BuildValue("(ss)", fields[i][0], fields[i][1]);
        if (!pair || PyTuple_SetItem(out, i, pair) < 0) Py_CLEAR(out);  /* steals pair */
    }
    return out;
}

PyDoc_STRVAR(env_choice_doc,
"env_choice($module, name, /)\n--\n\n"
"The value of setting `name` (a choice of the table: backend, platform, log, ...) as its variable\n"
"says now, in the table's spelling; its default ('' for none) where it is unset or malformed.");

static PyObject *env_choice(PyObject *module, PyObject *arg)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8AndSize(arg, NULL);
    if (!name) return NULL;
    const struct tms_setting_row *r = tms_setting_find(name);
    if (!r || (r->type != TMS_SETTING_TYPE_choice && r->type != TMS_SETTING_TYPE_choice_anycase))
        return PyErr_Format(PyExc_ValueError, "torch_memory_saver: no setting %s is a choice", name);
    return PyUnicode_FromString(tms_setting_text_now((int)(r - tms_setting_rows)));
}

static PyMethodDef module_methods[] = {
    {"env_choice", env_choice, METH_O, env_choice_doc},
    {"report_fields", report_fields, METH_NOARGS, report_fields_doc},
    {"names", names, METH_NOARGS, names_doc},
    {"is_known", is_known, METH_O, is_known_doc},
    {"settings", settings, METH_NOARGS, settings_doc},
    {"check_setting", check_setting, METH_VARARGS, check_setting_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_tms_env",
    .m_doc = "Raises ValueError at import naming the first malformed TMS_* variable (config.c parses them); "
              "names the variables the library reads, describes its settings and checks run-time values.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

TMS_EXPORT PyObject *PyInit__tms_env(void) { return PyModuleDef_Init(&module_def); }
