/* A setting's value between Python and C: converted here, checked by the table's own check (platform/config.h), one way in every module that takes one (the variants' set_<name>, _tms_env.check_setting). */
#ifndef TMS_FACE_PY_SETTINGS_H
#define TMS_FACE_PY_SETTINGS_H

#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030A0000  /* the stable ABI, as every module of the package */
#endif
#include <Python.h>

#include "face/py_weak.h"
#include "platform/config.h"

/* A run-time setting's value in C: flag for a bool, number for the others. */
union tms_py_setting {
    int flag;
    unsigned long long number;
};

/* value as row r's: a bool for a bool setting (TypeError for anything else, 0 and 1
 * included), an int for a number (TypeError for a bool or another type; ValueError
 * "<name> must be ..., got <value>" outside the row's bounds, from tms_setting_check).
 * 0, or -1 with the exception set; every message starts "torch_memory_saver: <name>". */
int tms_py_setting_value(const struct tms_setting_row *r, PyObject *value, union tms_py_setting *out);

/* value as a text setting's (row r, a CALL row): None (*out NULL: none), or a str the row
 * takes (TypeError for another type, ValueError "<name> '<value>' is not ..."). 0, or -1
 * with the exception set; *out lives as long as value. */
int tms_py_setting_text(const struct tms_setting_row *r, PyObject *value, const char **out);

/* The C value of a run-time setting of each type from the union, and the Python object of one. */
#define TMS_PY_SETTING_AS(type, v) TMS_PY_SETTING_AS_##type(v)
#define TMS_PY_SETTING_AS_boolean(v) ((v).flag)
#define TMS_PY_SETTING_AS_count(v) ((int)(v).number)
#define TMS_PY_SETTING_AS_size(v) ((size_t)(v).number)
#define TMS_PY_SETTING_OBJECT(type, x) TMS_PY_SETTING_OBJECT_##type(x)
#define TMS_PY_SETTING_OBJECT_boolean(x) PyBool_FromLong(x)
#define TMS_PY_SETTING_OBJECT_count(x) PyLong_FromLong(x)
#define TMS_PY_SETTING_OBJECT_size(x) PyLong_FromSize_t(x)

#endif
