/* The settings that change while the process runs (the RUN rows of config.h's table): one value each, the environment's until a face sets another. */
#include <pthread.h>
#include <stddef.h>

#include "core/core.h"
#include "platform/config.h"

/* Each row's value starts as the environment's (read on first use, from any thread) and is
 * then read and written atomically: a setter racing a reader gives it the old or the new. A
 * bool is kept as 0 or 1. */
#define KEEP_boolean(v) ((v) ? 1 : 0)
#define KEEP_count(v) (v)
#define KEEP_size(v) (v)

#define RUN_VALUE(name, type, set, get)                                                                        \
    static TMS_SETTING_CTYPE(type) name##_value;  /* atomic once name##_once ran */                            \
    static pthread_once_t name##_once = PTHREAD_ONCE_INIT;                                                     \
    static void name##_load(void) { __atomic_store_n(&name##_value, tms_defaults()->name, __ATOMIC_RELAXED); } \
    void set(TMS_SETTING_CTYPE(type) value)                                                                    \
    {                                                                                                          \
        pthread_once(&name##_once, name##_load);                                                               \
        __atomic_store_n(&name##_value, KEEP_##type(value), __ATOMIC_RELAXED);                                 \
    }                                                                                                          \
    TMS_SETTING_CTYPE(type) get(void)                                                                          \
    {                                                                                                          \
        pthread_once(&name##_once, name##_load);                                                               \
        return __atomic_load_n(&name##_value, __ATOMIC_RELAXED);                                               \
    }
#define RUN_ROW(name, type, env, dflt, range, accepts, when, doc)                                              \
    TMS_SETTING_IF_RUN(when, RUN_VALUE(name, type, TMS_SETTING_SETTER(when), TMS_SETTING_GETTER(when)))
TMS_SETTINGS(RUN_ROW)
