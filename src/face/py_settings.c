/* A Python value of a setting converted to C and checked, for every module that takes one. */
#include "face/py_settings.h"

#include <stdint.h>
#include <string.h>

static PyObject *type_error(const struct tms_setting_row *r, const char *expected, PyObject *value)
{
    PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(value), "__name__");  /* no tp_name in the limited API */
    if (name) {
        PyErr_Format(PyExc_TypeError, "torch_memory_saver: %s must be %s, not %U", r->name, expected, name);
        Py_DECREF(name);
    }
    return NULL;
}

/* The number in C, or which way it does not fit 64 bits (sign), and how it is written. */
static int check_number(const struct tms_setting_row *r, PyObject *value, unsigned long long *out)
{
    int sign = 0, below = PyObject_RichCompareBool(value, Py_False, Py_LT);  /* False == 0, no int made */
    if (below < 0) return -1;
    unsigned long long n = 0;
    if (below) {
        sign = -1;
    } else {
        n = PyLong_AsUnsignedLongLong(value);
        if (n == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
            PyErr_Clear();
            sign = 1;
        }
    }
    struct tms_err err = {0};
    if (tms_setting_check(r, sign, n, "", &err) == TMS_OK) {
        *out = n;
        return 0;
    }
    PyObject *text = PyObject_Str(value);
    const char *digits = text ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
    if (digits) {
        tms_setting_check(r, sign, n, digits, &err);
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", err.msg);
    }
    Py_XDECREF(text);
    return -1;
}

int tms_py_setting_value(const struct tms_setting_row *r, PyObject *value, union tms_py_setting *out)
{
    int is_boolean = value == Py_True || value == Py_False;
    if (r->type == TMS_SETTING_TYPE_boolean) {
        if (!is_boolean) return type_error(r, "a bool", value), -1;
        out->flag = value == Py_True;
        return 0;
    }
    if (is_boolean || !PyLong_Check(value)) return type_error(r, "an int", value), -1;
    return check_number(r, value, &out->number);
}

int tms_py_setting_text(const struct tms_setting_row *r, PyObject *value, const char **out)
{
    *out = NULL;
    if (value == Py_None) return 0;
    if (!PyUnicode_Check(value)) return type_error(r, "a str or None", value), -1;
    Py_ssize_t len = 0;
    if (!(*out = PyUnicode_AsUTF8AndSize(value, &len))) return -1;
    /* C sees a value only up to its first NUL: the rest would be dropped unseen. */
    if (strlen(*out) != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s %R holds a NUL character ('\\x00'): it is not %s",
                     r->name, value, tms_setting_accepts(r));
        *out = NULL;
        return -1;
    }
    struct tms_err err = {0};
    if (tms_setting_check_text(r, *out, &err) == TMS_OK) return 0;
    PyErr_Format(PyExc_ValueError, "torch_memory_saver: %s", err.msg);
    return -1;
}
